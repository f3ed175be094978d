"""broker_server"""
