"""Models: finding and loading weights (`loader`) and our own decoder implementations."""
