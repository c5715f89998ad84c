"""The gym gateway: consumes rollout tasks, drives environments/agents through a per-rollout
session proxy in front of the generators, and publishes token-exact trajectories."""
