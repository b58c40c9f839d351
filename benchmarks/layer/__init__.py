"""One normalization layer against BatchNorm, and the selections under it."""
