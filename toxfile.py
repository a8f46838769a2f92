"""tox's inline plugin for kvstrata's test environments (tox loads ``toxfile.py`` from the project root).

With ``KVSTRATA_TOX_DISCARD_ENVS=1`` each test environment's directory is removed once its commands have run,
so that a full ``tox`` run holds one environment on disk at a time instead of all five (about 13 GB: the SGLang
env alone is 6 GB, torch's CUDA build that SGLang pins). ``.ci/run`` sets it, since a CI machine's free disk
varies; on a developer's machine the envs stay, so a second run does not reinstall them.
"""

from __future__ import annotations

import logging
import os
import shutil

from tox.plugin import impl
from tox.tox_env.api import ToxEnv
from tox.tox_env.package import PackageToxEnv

DISCARD_ENVS = "KVSTRATA_TOX_DISCARD_ENVS"


@impl
def tox_env_teardown(tox_env: ToxEnv) -> None:
    """Called by tox after an environment's commands ran (pass or fail)."""
    if os.environ.get(DISCARD_ENVS) != "1" or isinstance(tox_env, PackageToxEnv):
        return  # the package env holds the wheel every test env installs: it stays for the run
    env_dir = tox_env.env_dir
    if env_dir.is_dir():
        shutil.rmtree(env_dir, ignore_errors=True)
        logging.warning("removed %s (%s=1)", env_dir, DISCARD_ENVS)  # tox prefixes the env name
