"""Rendezvous: which nodes form the next round, and where their stores live."""
