"""clora.learner"""
