"""The training loop (`trainer`): its state and steps, the compiled programs,
sharding over devices, checkpoints, the health checks, the captured norm-layer
inputs, and the host setup that comes before JAX starts (`host_devices`,
`host_memory`)."""
