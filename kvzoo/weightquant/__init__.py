"""Weight quantization (AWQ / RTN 4-bit) for the model zoo."""
