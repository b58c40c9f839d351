"""Sweeps: a grid of runs (`grid`) run as training processes (`runs`) with
their progress (`progress`), through ``python -m train.sweep`` (`cli`)."""
