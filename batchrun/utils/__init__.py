"""Small helpers shared by every layer (the bottom of the layer contract; imports nothing above)."""
