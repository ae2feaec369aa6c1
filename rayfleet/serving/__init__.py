"""rayfleet.serving"""
