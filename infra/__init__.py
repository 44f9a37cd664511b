"""clora.infra"""
