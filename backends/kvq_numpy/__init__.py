"""kvq's NumPy reference backend: the readable truth every other backend is proven equal to."""
