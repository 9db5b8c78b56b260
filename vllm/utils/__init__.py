"""Helpers under upstream vLLM's module names (`network_utils.get_ip`, imported by TRL's client)."""
