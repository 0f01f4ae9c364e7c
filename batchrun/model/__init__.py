"""Model layer: decoder definitions for paged attention, weight loading, quantized linear layers."""
