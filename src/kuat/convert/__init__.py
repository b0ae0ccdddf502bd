"""Converters from common formats into kuat datasets."""
