"""rayfleet.platform"""
