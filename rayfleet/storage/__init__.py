"""rayfleet.storage"""
