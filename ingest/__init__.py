"""clora.ingest"""
