"""clora.serving"""
