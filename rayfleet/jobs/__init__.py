"""rayfleet.jobs"""
