"""Rank processes: the warm launcher, loopback rendezvous, the rank-side runner, and the
orchestration of one multirank run. Imports neither pytest nor, until a rank needs it, torch.
"""
