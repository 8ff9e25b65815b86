"""The distributed plumbing every role shares: the torchrun environment and meshes (`mesh`), collectives over
the default group (`collectives`), fail-fast on a dead or hung peer (`failfast`), Ctrl-C / SIGTERM at safe
points (`interrupt`) and the heartbeat of a long stage (`heartbeat`).

It sits below `trainer/`, `eval/` and `rollout/` and imports none of them, so every package above can use it
without an import running upward (docs/architecture.md, the package layout)."""
