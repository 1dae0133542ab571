"""correlate"""
