"""A throwaway git repository with a tiny language model, its base commit and two heads.

The base's ``models.py:make`` returns a one-block parallel decoder that calls SDPA, with a ``step``
for torchparity's decoding loop. :data:`CHANGES` are the edits a head makes to it: ``real``
switches the MLP's GELU to its tanh approximation (a real change of the math), ``reordered``
adds the attention's and the MLP's outputs before the residual stream rather than one after
the other into it, a parallel block's sum in another order (rounding noise only).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

MODELS = '''\
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS = 16, 16, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        h = F.gelu(self.up(x))
        return self.down(h)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), MLP()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(self.norm1(x)) + self.mlp(self.norm2(x))
        return self.head(x)


def step(model, tokens, state):
    tokens = tokens if state is None else torch.cat([state, tokens], dim=1)
    return model(tokens)[:, -1], tokens


def make():
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    return {"model": TinyLM(), "inputs": tokens, "step": step}
'''

#: Head name -> (text of the base's models.py, what the head puts there).
CHANGES = {
    "real": ("h = F.gelu(self.up(x))", 'h = F.gelu(self.up(x), approximate="tanh")'),
    "reordered": ("x = x + self.attn(self.norm1(x)) + self.mlp(self.norm2(x))",
                  "x = x + (self.attn(self.norm1(x)) + self.mlp(self.norm2(x)))"),
}


def git(repo: Path, *args: str, input: str | None = None, env: dict | None = None) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True,
                          input=input, env=env)
    return done.stdout


def make_repository(root: Path) -> Path:
    """A repository in ``root`` with ``models.py`` committed on branch ``main``."""
    root.mkdir(parents=True, exist_ok=True)
    git(root, "init", "--quiet", "--initial-branch=main")
    git(root, "config", "user.name", "Toy Author")
    git(root, "config", "user.email", "toy@example.com")
    (root / "models.py").write_text(MODELS)
    git(root, "add", "models.py")
    git(root, "commit", "--quiet", "-m", "a tiny language model")
    return root


def change(repo: Path, head: str) -> None:
    """Edit the working tree's models.py as ``head`` of :data:`CHANGES` says (uncommitted)."""
    before, after = CHANGES[head]
    path = repo / "models.py"
    text = path.read_text()
    assert before in text
    path.write_text(text.replace(before, after))


def commit_variant(repo: Path, branch: str, code: str) -> None:
    """Commit on a new ``branch`` (off ``main``) a models.py whose ``make`` runs ``code``
    first, with git's plumbing: the checkout and the index are not touched."""
    body = "".join(f"    {line}\n" for line in code.splitlines())
    text = MODELS.replace("def make():\n", "def make():\n" + body)
    blob = git(repo, "hash-object", "-w", "--stdin", input=text).strip()
    index = {**os.environ, "GIT_INDEX_FILE": str(repo / ".git" / f"index-{branch}")}
    git(repo, "read-tree", "main", env=index)
    git(repo, "update-index", "--cacheinfo", f"100644,{blob},models.py", env=index)
    tree = git(repo, "write-tree", env=index).strip()
    Path(index["GIT_INDEX_FILE"]).unlink()
    commit = git(repo, "commit-tree", tree, "-p", "main", "-m", f"make: {branch}").strip()
    git(repo, "branch", branch, commit)


def state(repo: Path) -> dict[str, str]:
    """What a run must leave as it was: branches, HEAD, index, working tree, stash and the
    list of worktrees."""
    return {"branches": git(repo, "for-each-ref", "--format=%(refname) %(objectname)"),
            "head": git(repo, "rev-parse", "HEAD"), "status": git(repo, "status", "--porcelain"),
            "index": git(repo, "ls-files", "--stage"), "diff": git(repo, "diff"),
            "stash": git(repo, "stash", "list"), "worktrees": git(repo, "worktree", "list")}
