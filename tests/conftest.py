"""Session-wide test set-up.

ansible-core 2.19 replaces ``sys.intern`` with a callable object when it is imported
(``ansible.module_utils._internal._patches``), and torch's dynamo refuses to import afterwards
("substitute_in_graph expects a function"); torch imports dynamo lazily, e.g. when the engine
builds its optimizer in ``init_weights``.  The module tests import ansible at collection time, so
import dynamo first, while ``sys.intern`` is still the builtin.  Production never loads both in
one process (the Ansible modules call torch-free parts of the package).
"""

try:
    import torch._dynamo  # noqa: F401
except ImportError:  # a host without torch runs the torch-free tests only
    pass
