"""Speculative decoding: one Speculator interface, one class per type, a Chain to combine them."""
