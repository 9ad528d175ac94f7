"""Device kernels (Triton) with their torch references."""
