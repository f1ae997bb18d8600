"""How the program runs over devices: the mesh and the logical-axis table (mesh.py), what each mesh
axis does (roles.py), which features compose (features.py), and the context split, collective
matmul and pipeline."""

from jaxtron.parallel.mesh import (  # noqa: F401 - the names callers take from the package
    MESH_AXES,
    OPTIONAL_AXES,
    batch_spec,
    bytes_per_device,
    check_divisible,
    check_layout,
    constrain,
    crossing_axes,
    describe,
    describe_hosts,
    devices_per_host,
    logical_specs,
    make_mesh,
    manual_axes,
    mesh_shape,
    mesh_specs,
    named,
    spec,
    spec_here,
)
