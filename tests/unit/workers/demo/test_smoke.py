"""`rlstream smoke`'s runner: client settings go with a given cluster, never with the broker it starts."""

import pytest

from schemas.errors import InvalidArgument
from workers.demo.smoke import run_smoke


def test_client_settings_without_a_cluster_are_refused_before_anything_starts():
    with pytest.raises(InvalidArgument, match="plaintext"):
        run_smoke(None, client_settings={"security.protocol": "SASL_SSL"}, log=lambda _: None)
