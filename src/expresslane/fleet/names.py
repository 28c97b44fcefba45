"""Names the fleet's modules share: the Serve application and its deployments."""

APP_NAME = "expresslane"
INGRESS = "ingress"


def pool_deployment_name(pool: str) -> str:
    return f"pool-{pool}"
