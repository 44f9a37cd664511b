"""clora.agents"""
