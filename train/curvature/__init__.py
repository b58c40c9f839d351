"""The training loss's curvature at a run's checkpoints: the Hessian's top
eigenvalues and trace and the gradient noise scale (`hessian`), measured into
each run directory through ``python -m train.curvature`` (`cli`)."""
