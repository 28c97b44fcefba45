"""Names the fleet's modules share: the Serve application, its deployments and the named
actors every replica finds."""

APP_NAME = "expresslane"
INGRESS = "ingress"


def pool_deployment_name(pool: str) -> str:
    return f"pool-{pool}"


def shared_actor(actor_class, name: str):
    """The cluster's one actor of this name, made by whoever asks first; detached, so it
    outlives the replica that made it."""
    return actor_class.options(
        name=name, namespace="serve", get_if_exists=True, lifetime="detached"
    ).remote()
