"""Image decoding and fused crop/resize/flip transforms."""
