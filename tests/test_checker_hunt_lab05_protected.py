"""Lab 5's victim policy against a protected-tenants set read only at its first element.

``ProtectInteractive(protected_tenants)`` takes a *collection* of tenants; every visible case protected one tenant,
so an answer that kept only ``protected_tenants[0]`` passed the notebook's checker (the grader's hidden cases then
took the points).  Oracle: the lab's fallback :class:`~minivllm.labs.check_lab05.ReferenceVictim`."""

from __future__ import annotations

from minivllm.labs import check_lab05
from tests.checker_verdicts import accepts, refuses


class _FirstTenantOnly:
    """Right least-work / newest-tie rule, but protects ``protected_tenants[0]`` alone."""

    def __init__(self, protected_tenants=("chat",)):
        self.protected = {protected_tenants[0]}

    def choose_victim(self, running):
        candidates = [r for r in running if r.tenant not in self.protected] or list(running)
        return min(reversed(candidates), key=lambda r: r.num_computed_tokens)


def test_a_policy_that_protects_only_the_first_tenant_fails_the_checker():
    running = [check_lab05._R("voice", "voice", 2), check_lab05._R("chat", "chat", 4),
               check_lab05._R("big", "batch", 300)]
    protected = ("chat", "voice")
    assert check_lab05.ReferenceVictim(protected).choose_victim(running).request_id == "big"
    assert _FirstTenantOnly(protected).choose_victim(running).request_id == "voice"  # a protected tenant preempted
    refuses(check_lab05.check_victim_policy, _FirstTenantOnly, "every listed tenant is protected", "not only the first")
    accepts(check_lab05.check_victim_policy, check_lab05.ReferenceVictim)
