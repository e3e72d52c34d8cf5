"""Offline stand-in for get-pip.py, used by ansible-test when it builds its sanity venvs.

ansible-test downloads get-pip from ci-files.testing.ansible.com, which this machine cannot reach.
tools/sanity.sh seeds ansible-test's cache with this file. It bootstraps pip from the stdlib wheel
(in a subprocess: ensurepip blanks PIP_CONFIG_FILE in its own process, which would drop the
machine's pip index configuration), then installs what was asked through the normal pip config.
"""

import subprocess
import sys

subprocess.check_call([sys.executable, "-m", "ensurepip", "--upgrade"])
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install"] + args))
