"""clora.kernels"""
