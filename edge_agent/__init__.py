"""edge_agent"""
