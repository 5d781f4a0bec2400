"""A small mixture of experts under overlap: some rank routes no token to some expert.

Two gloo ranks; a router picks one of four experts per token (argmax), and rank 0 has so few
tokens that some expert gets none there. Each expert is a unit of its own (unit_policy "auto":
four blocks of one class in a ModuleList), so a rank that skipped an expert would skip its
all-gather: ZeRO-3's known hang.

- Experts called with an empty batch (what grouped-expert kernels do): every unit runs on every
  rank, an expert without tokens gives zero gradients there; losses and parameters equal DDP's bit
  for bit every step (two ranks: [Note: what is bitwise] in tolerance.py).
- Experts skipped when empty: the ranks' unit orders differ and every rank raises at the first
  forward (overlap checks the order of the first step), instead of hanging in a collective.

Four gloo ranks, experts as torchtitan's GroupedExperts hold them (weights stacked [experts, ...],
every expert run every step on the rows routed to it, possibly none):

- data-parallel over all four ranks, one rank routing its two tokens to two experts at most:
  against FSDP2 (`fully_shard` on the experts and the root, the same 1-D dp mesh) every step, within
  `reordered_rtol` of a 4-way sum (the ranks' gradients are summed in another order: gloo's
  reduce-scatter beside overlap's all-to-all sum);
- expert parallelism (the stacked weights `Shard(0)` over an `ep` mesh dimension that splits the
  data-parallel ranks, torchtitan's ExpertParallel) with any group but the whole (dp_mod_ep, ep)
  mesh: refused at wrap on every rank with the same message, naming the group to pass
  ([Note: expert parallelism] in overlap/engine/experts.py; supported, tests/parity/test_expert_parallel.py).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from helpers.tolerance import reordered_mismatches, reordered_rtol
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap

DIM, EXPERTS = 16, 4


class MoE(nn.Module):
    def __init__(self, skip_empty: bool) -> None:
        super().__init__()
        self.skip_empty = skip_empty
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM)) for _ in range(EXPERTS)
        )
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        gate = self.router(x).softmax(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(-1)
            if self.skip_empty and rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(x[rows]) * gate[rows, index : index + 1])
        return self.head(out + x)


def _batch(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(2 if rank == 0 else 16, DIM, generator=gen)  # 2 tokens: 2 experts at most


def check_empty_experts(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    base = MoE(skip_empty=False)
    ref = DDP(copy.deepcopy(base))
    ours = overlap.wrap(base)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, idle = [], []
    for step in range(3):
        x = _batch(rank, step)
        with torch.no_grad():
            idle.append(EXPERTS - len(set(ref.module.router(x).argmax(-1).tolist())) if rank == 0 else 0)
        loss, ref_loss = ours(x).pow(2).mean(), ref(x).pow(2).mean()
        loss.backward()
        ref_loss.backward()
        losses.append((loss.item(), ref_loss.item()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    theirs = dict(ref.module.named_parameters())
    differ = [n for n, p in ours.named_parameters() if not torch.equal(p.full_tensor(), theirs[n].detach())]
    return {"losses": losses, "differ": differ, "idle": idle}


def check_skipped_experts(rank: int, world_size: int) -> str | None:
    torch.manual_seed(0)
    model = overlap.wrap(MoE(skip_empty=True))
    try:
        for step in range(2):
            model(_batch(rank, step)).pow(2).mean().backward()
    except ValueError as error:
        return str(error)
    return None


def test_experts_without_tokens_train_as_ddp(world2):
    results = world2.run(check_empty_experts, timeout_s=120)
    assert sum(results[0]["idle"]) > 0, "rank 0 must leave some expert without tokens"
    for rank, result in enumerate(results):
        assert all(a == b for a, b in result["losses"]), (rank, result["losses"])
        assert not result["differ"], (rank, result["differ"])


def test_skipped_experts_raise_on_every_rank_instead_of_hanging(world2):
    messages = world2.run(check_skipped_experts, timeout_s=120)
    assert all(m is not None and "order of units differs" in m for m in messages), messages


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts in miniature: the experts' weights stacked [experts, ...]; every
    expert runs on its rows of the sorted tokens, an empty slice when none was routed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, 2 * DIM) * DIM**-0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, 2 * DIM, DIM) * (2 * DIM) ** -0.5)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        rows = x.split(counts)
        return torch.cat([torch.relu(r @ self.w1[e]) @ self.w2[e] for e, r in enumerate(rows)])


class GroupedMoE(nn.Module):
    """Top-1 routing: tokens sorted by expert, the grouped experts, the gate, back in place."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = GroupedExperts()
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x).softmax(-1)
        choice = scores.argmax(-1)
        order = choice.argsort(stable=True)
        counts = torch.bincount(choice, minlength=EXPERTS).tolist()
        self.counts = counts  # for the test: the experts this rank left without tokens
        y = self.experts(x[order], counts) * scores[order].gather(1, choice[order, None])
        return self.head(torch.zeros_like(x).index_copy(0, order, y) + x)


STEPS = 3
_MESH: list[DeviceMesh] = []  # per rank: (dp_mod_ep, ep) = (2, 2), built once (it makes groups)


def _ep_mesh() -> DeviceMesh:
    if not _MESH:
        _MESH.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep")))
    return _MESH[0]


def check_grouped_experts(rank: int, world_size: int) -> dict:
    """overlap and FSDP2 over the same 1-D dp mesh of every rank (the flattened (dp_mod_ep, ep)),
    the same model and batches; rank 0 leaves some expert without tokens every step."""
    from torch.distributed.fsdp import fully_shard

    dp = _ep_mesh()._flatten("dp")
    torch.manual_seed(0)
    ours = overlap.wrap(GroupedMoE(), group=dp)
    torch.manual_seed(0)
    ref = GroupedMoE()
    fully_shard(ref.experts, mesh=dp)
    fully_shard(ref, mesh=dp)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out: dict = {"losses": [], "idle": [], "params": []}
    for step in range(STEPS):
        x = _batch(rank, step)
        losses = []
        for model in (ours, ref):
            loss = model(x).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        out["losses"].append(tuple(losses))
        out["idle"].append(ours.counts.count(0))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        theirs = {n: p.full_tensor().detach() for n, p in ref.named_parameters()}
        mine = {n: p.full_tensor().detach() for n, p in ours.named_parameters()}
        out["params"].append((mine, theirs))
    return out


def test_grouped_experts_without_tokens_match_fsdp2(world4):
    rtol = reordered_rtol(4, STEPS)
    results = world4.run(check_grouped_experts, timeout_s=60)
    assert all(i > 0 for i in results[0]["idle"]), ("rank 0 must leave some expert without tokens", results[0]["idle"])
    for rank, result in enumerate(results):
        assert all(abs(a - b) <= rtol * abs(b) for a, b in result["losses"]), (rank, result["losses"])
        for step, (mine, theirs) in enumerate(result["params"]):
            bad = reordered_mismatches(mine, theirs, rtol)
            assert not bad, (rank, step, bad)


def _ep_model(ep: DeviceMesh) -> GroupedMoE:
    """The experts placed as torchtitan's ExpertParallel places them: Shard(0) over `ep`."""
    torch.manual_seed(0)
    model = GroupedMoE()
    for name in ("w1", "w2"):
        weight = getattr(model.experts, name)
        setattr(model.experts, name, nn.Parameter(distribute_tensor(weight.detach(), ep, [Shard(0)])))
    return model


def check_expert_parallel_refused(rank: int, world_size: int) -> dict[str, str | None]:
    """Per case: the message wrap raised, None when it accepted the model. The whole
    (dp_mod_ep, ep) mesh is expert parallelism (tests/parity/test_expert_parallel.py)."""
    mesh = _ep_mesh()
    # the same ranks under names that say nothing of experts: refused by the ranks alone
    anonymous = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=("rows", "cols"))
    cases = {
        "dp_mod_ep": (mesh["ep"], mesh["dp_mod_ep"]),
        "flattened dp": (mesh["ep"], mesh._flatten("dp")),
        "default group": (mesh["ep"], None),
        "unnamed experts dim, flattened dp": (anonymous["cols"], anonymous._flatten("everyone")),
    }
    out: dict[str, str | None] = {}
    for case, (ep, group) in cases.items():
        try:
            overlap.wrap(_ep_model(ep), group=group)
            out[case] = None
        except ValueError as error:
            out[case] = str(error)
    return out


def test_expert_parallelism_over_another_group_is_refused_on_every_rank(world4):
    results = world4.run(check_expert_parallel_refused, timeout_s=60)
    for case in results[0]:
        messages = [r[case] for r in results]
        assert all(m is not None for m in messages), (case, messages)
        assert len(set(messages)) == 1, (case, messages)
        for needle in (
            "'experts.w1'",
            "not supported",
            "pass the whole data-parallel mesh",
            "keep the experts data-parallel",
        ):
            assert needle in messages[0], (case, needle, messages[0])
        assert ("mesh dimension 'ep'" in messages[0]) == (case != "unnamed experts dim, flattened dp"), (
            case,
            messages[0],
        )
