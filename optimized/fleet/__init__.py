"""Role pools: the engine as encoder / denoiser / decoder roles in their own processes, typed transfers between
them, replicas, routing and failover (issue #26).

    transfer.py     TensorEntry, TransferManifest (+ check), pack / unpack a stage value, content_key
    transports.py   Transport protocol; InProcessTransport, SharedMemoryTransport, TorchDistTransport
    stages.py       where a program splits into roles (derived from its phase / stage declarations)
    roles.py        RoleSpec, RoleWorker (a resident engine for one role, own process), LocalFleet
    deployment.py   deployment.yaml -> DeploymentSpec;  router.py  placement, health, failover
    ray_pool.py     role pools as Ray actors;            card.py    the DeploymentCard's fleet section
"""
