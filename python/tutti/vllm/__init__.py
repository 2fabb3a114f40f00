"""tutti for vLLM (docs/vllm.md): `TuttiConnector`, a KV connector over tuttid, and `TuttiTier`,
a secondary tier behind vLLM's CPU offloading. Importing this module imports vLLM and torch
(the `tutti[vllm]` extra); `import tutti` does not."""

from __future__ import annotations

import vllm

from tutti._engine import check_engine_version

# The vLLM release these classes were tested against (tools/python/engine-env.sh pins the same).
TESTED_VLLM_VERSION = "0.32.0"


def check_vllm_version() -> bool:
    """Warns (naming the tested version) when the installed vLLM is another release."""
    return check_engine_version("vLLM", vllm.__version__, TESTED_VLLM_VERSION)


from tutti.vllm.connector import TuttiConnector, TuttiConnectorMetadata  # noqa: E402
from tutti.vllm.tier import TuttiTier  # noqa: E402

__all__ = ["TESTED_VLLM_VERSION", "TuttiConnector", "TuttiConnectorMetadata", "TuttiTier", "check_vllm_version"]
