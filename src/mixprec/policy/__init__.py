"""The op-precision policy: categories, base tables and the frozen `Policy` object.

Pure data and pure functions: nothing here casts a tensor. The eager autocast engine compiles a
resolved policy into a dispatch table; tests and reports read the same tables.
"""

from mixprec.policy.categories import Decision, OpCategory
from mixprec.policy.entrypoints import entry_points, known_op_names, op_name
from mixprec.policy.policy import Override, Policy, ResolvedPolicy
from mixprec.policy.tables import TABLES, OpTable

__all__ = [
    "TABLES",
    "Decision",
    "OpCategory",
    "OpTable",
    "Override",
    "Policy",
    "ResolvedPolicy",
    "entry_points",
    "known_op_names",
    "op_name",
]
