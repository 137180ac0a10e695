"""Pure math, no I/O: devices, meshes, shardings, host blocks, output layouts."""
