"""Notebook 02 as a script: REINFORCE on CartPole with one agent and several
observers, the agent holding ``RRef(self)`` and the observers, created with
``remote()``, calling it back for every action.

Written as PyTorch's tutorial "Getting Started with Distributed RPC Framework"
writes it (``mp.spawn``, ``init_rpc``, rank 0 is the agent, the other ranks
observers); the import names nbrpc. What differs from the tutorial, and why
(notebook 02 says more):

* gymnasium instead of gym: ``reset(seed=)`` instead of ``env.seed()``,
  ``reset()`` returns ``(state, info)`` and ``step()`` five values;
* each observer's actions come from its own seeded generator, and the agent
  records states and actions and computes the log-probabilities per episode
  in one batch (so a run does not depend on thread timing; no ``Dropout``);
* returns are discounted per observer (the tutorial discounts the
  concatenation of all observers' rewards).

Run: ``python examples/02_rl_observers.py [--world-size W] [--reward-threshold R]``.
"""

from __future__ import annotations

import argparse
import os
import socket
from itertools import count

import gymnasium as gym
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn, optim
from torch.distributions import Categorical

from nbrpc import rpc  # torch.distributed.rpc
from nbrpc.rpc import RRef, remote, rpc_async, rpc_sync

AGENT_NAME = "agent"
OBSERVER_NAME = "obs{}"
TOTAL_EPISODE_STEP = 5000
GAMMA = 0.99
SEED = 543


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.affine1(x))
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=1)


class Observer:
    def __init__(self) -> None:
        self.id = rpc.get_worker_info().id
        self.env = gym.make("CartPole-v1")
        self.env.reset(seed=SEED + self.id)

    def run_episode(self, agent_rref: RRef, n_steps: int) -> None:
        state, _ = self.env.reset()
        for _ in range(n_steps):
            # send the state to the agent to get an action
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)
            # apply the action to the environment, and get the reward
            state, reward, terminated, truncated, _ = self.env.step(action)
            # report the reward to the agent for training purpose
            _remote_method(Agent.report_reward, agent_rref, self.id, reward)
            if terminated or truncated:
                break


class Agent:
    def __init__(self, world_size: int) -> None:
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards: dict[int, list[float]] = {}
        self.saved_states: dict[int, list[torch.Tensor]] = {}
        self.saved_actions: dict[int, list[torch.Tensor]] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.eps = torch.finfo(torch.float32).eps
        self.running_reward = 0.0
        self.reward_threshold = gym.make("CartPole-v1").spec.reward_threshold
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, Observer))
            self.rewards[ob_info.id] = []
            self.saved_states[ob_info.id] = []
            self.saved_actions[ob_info.id] = []
            self.generators[ob_info.id] = torch.Generator().manual_seed(SEED + ob_info.id)

    def select_action(self, ob_id: int, state) -> int:
        state = torch.from_numpy(state).float().unsqueeze(0)
        with torch.no_grad():
            probs = self.policy(state)
        action = torch.multinomial(probs, 1, generator=self.generators[ob_id])[:, 0]
        self.saved_states[ob_id].append(state)
        self.saved_actions[ob_id].append(action)
        return action.item()

    def report_reward(self, ob_id: int, reward: float) -> None:
        self.rewards[ob_id].append(reward)

    def run_episode(self, n_steps: int = 0) -> None:
        futs = []
        for ob_rref in self.ob_rrefs:
            # make async RPC to kick off an episode on all observers
            futs.append(rpc_async(ob_rref.owner(), _call_method,
                                  args=(Observer.run_episode, ob_rref, self.agent_rref, n_steps)))
        # wait until all observers have finished this episode
        for fut in futs:
            fut.wait()

    def finish_episode(self) -> float:
        log_probs, returns = [], []
        for ob_id, rewards in self.rewards.items():
            R, ob_returns = 0.0, []
            for r in rewards[::-1]:
                R = r + GAMMA * R
                ob_returns.insert(0, R)
            returns.extend(ob_returns)
            states = torch.cat(self.saved_states[ob_id])
            actions = torch.cat(self.saved_actions[ob_id])
            log_probs.append(Categorical(self.policy(states)).log_prob(actions))
        # use the minimum observer reward to calculate the running reward
        min_reward = min(sum(r) for r in self.rewards.values())
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward
        # clear saved states, actions and rewards
        for ob_id in self.rewards:
            self.rewards[ob_id] = []
            self.saved_states[ob_id] = []
            self.saved_actions[ob_id] = []
        returns_t = torch.tensor(returns)
        returns_t = (returns_t - returns_t.mean()) / (returns_t.std() + self.eps)
        policy_loss = -(torch.cat(log_probs) * returns_t).sum()
        self.optimizer.zero_grad()
        policy_loss.backward()
        self.optimizer.step()
        return min_reward


def run_worker(rank: int, world_size: int, port: int, threshold: float | None,
               max_episodes: int, log_interval: int) -> None:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    if rank == 0:
        # rank0 is the agent
        rpc.init_rpc(AGENT_NAME, rank=rank, world_size=world_size)
        torch.manual_seed(SEED)
        agent = Agent(world_size)
        if threshold is not None:
            agent.reward_threshold = threshold
        for i_episode in count(1):
            n_steps = int(TOTAL_EPISODE_STEP / (world_size - 1))
            agent.run_episode(n_steps=n_steps)
            last_reward = agent.finish_episode()
            if i_episode % log_interval == 0:
                print(f"Episode {i_episode}\tLast reward: {last_reward:.2f}\t"
                      f"Average reward: {agent.running_reward:.2f}", flush=True)
            if agent.running_reward > agent.reward_threshold:
                print(f"Solved! Running reward is now {agent.running_reward:.2f} "
                      f"after {i_episode} episodes!", flush=True)
                break
            if i_episode >= max_episodes:
                print(f"Not solved in {max_episodes} episodes", flush=True)
                break
    else:
        # other ranks are the observer
        rpc.init_rpc(OBSERVER_NAME.format(rank), rank=rank, world_size=world_size)
        # observers passively waiting for instructions from the agent
    # block until all rpcs finish, and shutdown the RPC instance
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description="nbrpc RL example (PyTorch's RPC tutorial)")
    parser.add_argument("--world-size", type=int, default=2,
                        help="world size for RPC, rank 0 is the agent, others are observers")
    parser.add_argument("--reward-threshold", type=float, default=None,
                        help="running reward to stop at (default: CartPole-v1's, 475)")
    parser.add_argument("--max-episodes", type=int, default=2000)
    parser.add_argument("--log-interval", type=int, default=10)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_worker,
             args=(args.world_size, port, args.reward_threshold, args.max_episodes,
                   args.log_interval),
             nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
