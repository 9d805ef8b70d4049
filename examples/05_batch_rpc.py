"""Notebook 05 as a script: the agent batches its observers' action requests
with ``@rpc.functions.async_execution``, and the same program runs batched and
unbatched for several world sizes, timed.

Written as PyTorch's tutorial "Implementing Batch RPC Processing Using
Asynchronous Executions" writes it (``mp.spawn`` per world size and mode,
rank 0 the agent, the other ranks observers); the import names nbrpc. What
differs from the tutorial, and why (notebooks 02 and 05 say more): gymnasium's
API instead of gym's; the policy on the CPU (no ``.cuda()``), its softmax over
the last dimension, without ``Dropout``; actions drawn from seeded generators
and log-probabilities computed per episode in one batch from the recorded
states and actions (a run does not depend on thread timing).

Run: ``python examples/05_batch_rpc.py [--world-sizes 2 3 5] [--num-episode N]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time

import gymnasium as gym
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn, optim
from torch.distributions import Categorical

from nbrpc import rpc  # torch.distributed.rpc

AGENT_NAME = "agent"
OBSERVER_NAME = "obs{}"
GAMMA = 0.99
SEED = 543


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.affine1(x))
        return F.softmax(self.affine2(x), dim=-1)


class Observer:
    def __init__(self, batch: bool = True) -> None:
        self.id = rpc.get_worker_info().id - 1
        self.env = gym.make("CartPole-v1")
        self.env.reset(seed=SEED + self.id)
        self.select_action = Agent.select_action_batch if batch else Agent.select_action

    def run_episode(self, agent_rref: rpc.RRef, n_steps: int) -> list:
        state, _ = self.env.reset()
        ep_reward = n_steps
        rewards = torch.zeros(n_steps)
        start_step = 0
        for step in range(n_steps):
            state = torch.from_numpy(state).float().unsqueeze(0)
            # send the state to the agent to get an action
            action = rpc.rpc_sync(agent_rref.owner(), self.select_action,
                                  args=(agent_rref, self.id, state))
            # apply the action to the environment, and get the reward
            state, reward, terminated, truncated, _ = self.env.step(action)
            rewards[step] = reward
            if terminated or truncated or step + 1 >= n_steps:
                curr_rewards = rewards[start_step:(step + 1)]
                R = 0
                for i in range(curr_rewards.numel() - 1, -1, -1):
                    R = curr_rewards[i] + GAMMA * R
                    curr_rewards[i] = R
                state, _ = self.env.reset()
                if start_step == 0:
                    ep_reward = min(ep_reward, step - start_step + 1)
                start_step = step + 1
        return [rewards, ep_reward]


class Agent:
    def __init__(self, world_size: int, batch: bool = True) -> None:
        self.ob_rrefs = []
        self.agent_rref = rpc.RRef(self)
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.running_reward = 0.0
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(rpc.remote(ob_info, Observer, args=(batch,)))
        self.batch = batch
        self.states = torch.zeros(len(self.ob_rrefs), 1, 4)
        self.generators = [torch.Generator().manual_seed(SEED + i)
                           for i in range(len(self.ob_rrefs))]
        self.saved: list | dict = [] if batch else {k: [] for k in range(len(self.ob_rrefs))}
        self.future_actions: torch.futures.Future = torch.futures.Future()
        self.lock = threading.Lock()
        self.pending_states = len(self.ob_rrefs)

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(agent_rref: rpc.RRef, ob_id: int,
                            state: torch.Tensor) -> torch.futures.Future:
        self = agent_rref.local_value()
        self.states[ob_id].copy_(state)
        future_action = self.future_actions.then(
            lambda future_actions: future_actions.wait()[ob_id].item()
        )
        with self.lock:
            self.pending_states -= 1
            if self.pending_states == 0:
                self.pending_states = len(self.ob_rrefs)
                with torch.no_grad():
                    probs = self.policy(self.states)
                actions = torch.multinomial(probs[:, 0], 1, generator=self.generators[0])
                self.saved.append((self.states.clone(), actions))
                future_actions = self.future_actions
                self.future_actions = torch.futures.Future()
                future_actions.set_result(actions)
        return future_action

    @staticmethod
    def select_action(agent_rref: rpc.RRef, ob_id: int, state: torch.Tensor) -> int:
        self = agent_rref.local_value()
        with torch.no_grad():
            probs = self.policy(state)
        action = torch.multinomial(probs, 1, generator=self.generators[ob_id])[:, 0]
        self.saved[ob_id].append((state, action))
        return action.item()

    def log_probs(self) -> torch.Tensor:
        """Log-probabilities of the episode's actions, one row per step."""
        if self.batch:
            states = torch.stack([s for s, _ in self.saved])
            actions = torch.stack([a for _, a in self.saved])
            return Categorical(self.policy(states)).log_prob(actions)[..., 0]
        per_observer = []
        for ob_id in range(len(self.ob_rrefs)):
            states = torch.cat([s for s, _ in self.saved[ob_id]])
            actions = torch.cat([a for _, a in self.saved[ob_id]])
            per_observer.append(Categorical(self.policy(states)).log_prob(actions))
        return torch.stack(per_observer).t()

    def run_episode(self, n_steps: int = 0) -> tuple[float, float]:
        futs = []
        for ob_rref in self.ob_rrefs:
            # make async RPC to kick off an episode on all observers
            futs.append(ob_rref.rpc_async().run_episode(self.agent_rref, n_steps))
        # wait until all observers have finished this episode
        rets = torch.futures.wait_all(futs)
        rewards = torch.stack([ret[0] for ret in rets]).t()
        ep_rewards = sum([ret[1] for ret in rets]) / len(rets)

        policy_loss = -self.log_probs() * rewards / len(rets)
        policy_loss.sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

        # reset variables
        self.saved = [] if self.batch else {k: [] for k in range(len(rets))}
        self.states = torch.zeros(len(self.ob_rrefs), 1, 4)

        # calculate running rewards
        self.running_reward = 0.5 * ep_rewards + 0.5 * self.running_reward
        return ep_rewards, self.running_reward


def run_worker(rank: int, world_size: int, port: int, n_episode: int, n_steps: int,
               batch: bool, print_log: bool = True) -> None:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    if rank == 0:
        # rank0 is the agent
        rpc.init_rpc(AGENT_NAME, rank=rank, world_size=world_size)
        torch.manual_seed(SEED)
        agent = Agent(world_size, batch)
        for i_episode in range(n_episode):
            last_reward, running_reward = agent.run_episode(n_steps=n_steps)
            if print_log:
                print(f"Episode {i_episode}\tLast reward: {last_reward:.2f}\t"
                      f"Average reward: {running_reward:.2f}", flush=True)
    else:
        # other ranks are the observer
        rpc.init_rpc(OBSERVER_NAME.format(rank), rank=rank, world_size=world_size)
        # observers passively waiting for instructions from agents
    rpc.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description="nbrpc batch RPC example (PyTorch's tutorial)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 5],
                        help="world sizes to time (the tutorial times 2 to 11)")
    parser.add_argument("--num-episode", type=int, default=10)
    parser.add_argument("--num-steps", type=int, default=500)
    parser.add_argument("--print-log", action="store_true", help="print every episode")
    args = parser.parse_args()
    print("world size, batched (s), unbatched (s)", flush=True)
    for world_size in args.world_sizes:
        delays = []
        for batch in [True, False]:
            tik = time.time()
            mp.spawn(run_worker,
                     args=(world_size, free_port(), args.num_episode, args.num_steps, batch,
                           args.print_log),
                     nprocs=world_size, join=True)
            tok = time.time()
            delays.append(tok - tik)
        print(f"{world_size}, {delays[0]:.2f}, {delays[1]:.2f}", flush=True)


if __name__ == "__main__":
    main()
