"""``worldloop show PATH [--out FILE]``: one self-contained HTML page of episodes, to read what an
agent saw, believed, predicted and did, turn by turn.

    worldloop show runs/eval-tiny-20250101-120000            # an eval output folder
    worldloop show runs/x/samples.jsonl --out /tmp/x.html    # a JSONL of sampled trajectories

Inputs
------
``PATH`` is either a folder holding ``episodes.jsonl`` (what ``worldloop eval --output`` writes) or a
JSONL file with one episode per line. Lines that are not JSON objects are skipped and counted in the
page header; an eval record re-played later (same ``key``) replaces the earlier one, as in eval.

Record shape (one JSON object per line; every field optional unless marked)
--------------------------------------------------------------------------
Episode: ``env`` or ``env_name`` (label), ``env_id`` + ``env_kwargs`` + ``seed`` (needed to re-play),
``success``, ``total_reward``, ``model``, ``policy_version``, ``trajectory_id`` or ``key``,
``end_reason``, ``error``, ``prompt_format`` / ``settings.prompt_format``, ``settings.state_format``,
and ``turns`` (required, a list). This is both the eval record of ``worldloop/eval/evaluate.py`` and
a :class:`worldloop.common.contracts.schemas.Trajectory` encoded as JSON (``msgspec.json.encode``: bytes
become base64 strings), so a run's sampled episodes can be written either way.

Turn: ``response`` or ``response_text`` (the model's text); ``observation``, ``reasoning``,
``prediction`` (parsed from the response in the episode's prompt format when absent); ``actions``;
``format_ok`` / ``reason``; rewards ``env_reward``, ``format_reward``, ``reasoning_reward`` (the
judge's) and ``reward`` (the turn's total; else the sum of those); ``done``, ``success``;
``state_before`` / ``state_after`` (``{"relations": [...], "symbolic": str | null, "structured": {...}}``,
the true states); the judge's ``grounding_score``, ``worldmodeling_score`` and ``judge`` (a free-form
map of details); ``images``: a list of PNG/JPEG images, each a base64 string, a ``data:image/...``
URL or the path of a file in the JSONL file's folder or below it (any other path is not read; an
integer, as in eval records, only counts them).

Eval records hold no images and no true states: when a record has ``env_id`` and ``seed`` and a
turn lacks them, the episode is re-played (``gymnasium.make(env_id, **env_kwargs)``, ``reset(seed)``,
then ``step(response)`` per turn; the envs are deterministic given the seed) to recover the image
before each turn and the true states; a re-play whose rewards or actions differ from the record is
flagged on the page instead of being shown as if it matched. The file is data, never code: only an
env id that worldloop registers (``worldloop.envs.ENV_IDS``) is re-played; any other id (gymnasium
would import the module that ``module:Env-v0`` names) is shown as unknown, with no re-play, and
nothing is imported. Env kwargs that name model weights to load (the SVG env's ``metric``,
``dino_model``, ``dreamsim_cache_dir``) are replaced by the pixel metric for the re-play.

Output: ``--out`` or ``episodes.html`` in the folder (``<name>.html`` beside a file). The page has
no external resource (images are ``data:`` URLs, the CSS is inline, no script; a
Content-Security-Policy forbids anything else), reflows from phone to desktop width without
horizontal scrolling, and escapes all recorded text.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import html
import io
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worldloop.show_style import CSS as _CSS

DEFAULT_MAX_EPISODES = 200
MAX_IMAGE_FILE_BYTES = 16 << 20
_DATA_URL_RE = re.compile(r"^data:image/(png|jpeg|gif|webp);base64,[A-Za-z0-9+/]+={0,2}$")
_B64_RE = re.compile(r"^[A-Za-z0-9+/\s]+={0,2}\s*$")
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpeg"), (b"GIF8", "gif"), (b"RIFF", "webp"))


# --------------------------------------------------------------------------- view model


@dataclass
class TurnView:
    index: int
    images: list[str] = field(default_factory=list)  # data: URLs
    prompt: str | None = None
    response: str = ""
    observation: str | None = None
    reasoning: str | None = None
    prediction: str | None = None
    state_before: str | None = None  # the true state, as text in the episode's state format
    state_after: str | None = None
    actions: list[str] = field(default_factory=list)
    format_ok: bool | None = None
    reason: str | None = None
    rewards: dict[str, float] = field(default_factory=dict)  # env, format, judge, total
    scores: dict[str, float] = field(default_factory=dict)  # the judge's scores
    judge: dict[str, Any] | None = None  # the judge's details
    done: bool = False
    success: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass
class EpisodeView:
    anchor: str
    env: str
    env_id: str | None
    seed: Any
    success: bool
    total_reward: float
    model: str | None = None
    policy_version: Any = None
    ident: str | None = None
    end_reason: str | None = None
    error: str | None = None
    prompt_format: str | None = None
    state_format: str = "natural_language"
    turns: list[TurnView] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- reading


def read_records(path: Path) -> tuple[list[dict], int, Path]:
    """(records, unreadable line count, the JSONL file) of an eval folder or a JSONL file.

    FileNotFoundError when there is nothing to read."""
    path = Path(path)
    file = path / "episodes.jsonl" if path.is_dir() else path
    if not file.is_file():
        what = "no episodes.jsonl in the folder" if path.is_dir() else "no such file"
        raise FileNotFoundError(f"{path}: {what}")
    records: list[dict] = []
    by_key: dict[str, int] = {}
    bad = 0
    with file.open("r", encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("turns", []), list):
                bad += 1
                continue
            key = rec.get("key")
            if isinstance(key, str) and key in by_key:  # eval: a re-played episode replaces the older line
                records[by_key[key]] = rec
                continue
            if isinstance(key, str):
                by_key[key] = len(records)
            records.append(rec)
    return records, bad, file


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _text(x: Any) -> str | None:
    return x if isinstance(x, str) else None


def _sniff(data: bytes) -> str | None:
    for magic, kind in _MAGIC:
        if data.startswith(magic) and (kind != "webp" or data[8:12] == b"WEBP"):
            return kind
    return None


def _data_url(data: bytes, kind: str) -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode('ascii')}"


def image_url(item: Any, base_dir: Path) -> str | None:
    """A ``data:`` URL for one recorded image (data URL, base64 string or the path of a file inside
    ``base_dir``, the folder being shown); None if it is not a readable PNG/JPEG/GIF/WebP there."""
    if not isinstance(item, str) or not item:
        return None
    if item.startswith("data:"):
        return item if _DATA_URL_RE.match(item) else None
    if len(item) > 64 and _B64_RE.match(item):
        try:
            data = base64.b64decode(item, validate=False)
        except (binascii.Error, ValueError):
            data = b""
        kind = _sniff(data)
        if kind:
            return _data_url(data, kind)
    if len(item) < 4096 and "://" not in item:
        p = Path(item) if Path(item).is_absolute() else base_dir / item
        try:
            # only an image inside the folder being shown: a record naming any other readable file
            # (/etc/..., ../../secret.png, a symlink out) must not copy it into the page
            p = p.resolve()
            if not p.is_relative_to(Path(base_dir).resolve()):
                return None
            if p.is_file() and p.stat().st_size <= MAX_IMAGE_FILE_BYTES:
                data = p.read_bytes()
                kind = _sniff(data)
                if kind:
                    return _data_url(data, kind)
        except OSError:
            return None
    return None


def array_url(image: Any) -> str | None:
    """A PNG ``data:`` URL of an HxWx3 uint8 array."""
    import numpy as np
    from PIL import Image

    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[2] not in (3, 4) or arr.size == 0:
        return None
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, format="PNG", optimize=True)
    return _data_url(buf.getvalue(), "png")


def describe(state: Any, state_format: str, env: Any = None) -> str | None:
    """A true state as text in ``state_format`` (the env's own wording when a re-play env is at hand)."""
    if not isinstance(state, dict):
        return None
    if env is not None:
        try:
            return str(env.unwrapped.describe_state(state))
        except Exception:  # noqa: BLE001 - a viewer shows what it can
            pass
    from types import SimpleNamespace

    from worldloop.envs.base import VisualEnv

    return VisualEnv.describe_state(SimpleNamespace(state_format=state_format), state)  # type: ignore[arg-type]


# env kwargs that make an env load model weights from a path or id (SVG's dino/dreamsim metrics):
# a re-play in the viewer loads none of what a file names, so it scores with the pixel metric
_WEIGHT_KWARGS = ("dino_model", "dreamsim_cache_dir")


def _replay(rec: dict, responses: list[str]) -> tuple[list[dict], Any, str | None]:
    """Re-play a recorded episode: per turn {"image", "state_before", "state_after", "reward",
    "actions"}, the env (closed), and why it could not be re-played (None when it could)."""
    env_id, seed = rec.get("env_id"), rec.get("seed")
    if not isinstance(env_id, str) or isinstance(seed, bool) or not isinstance(seed, int):
        return [], None, "the record names no env_id and seed to re-play"
    from worldloop.envs import ENV_IDS  # registers the ids

    if env_id not in ENV_IDS:  # never gymnasium.make it: "module:Env-v0" would import module
        return [], None, (f"unknown env id {env_id!r}: not one that worldloop registers, so the episode is not "
                          "re-played (a viewer imports nothing a file names)")
    kwargs = rec.get("env_kwargs") if isinstance(rec.get("env_kwargs"), dict) else {}
    kwargs = {k: v for k, v in kwargs.items() if k not in _WEIGHT_KWARGS}
    if "metric" in kwargs:
        kwargs["metric"] = "pixel"
    try:
        import warnings

        import gymnasium

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            env = gymnasium.make(env_id, **kwargs)
        out: list[dict] = []
        try:
            obs, info = env.reset(seed=seed)
            for response in responses:
                before = info.get("state")
                image = obs.get("image") if isinstance(obs, dict) else None
                obs, reward, term, trunc, info = env.step(response)
                out.append({"image": image, "state_before": before, "state_after": info.get("state"),
                            "reward": float(reward), "actions": list(info.get("actions") or [])})
                if term or trunc:
                    break
        finally:
            env.close()
        return out, env, None
    except Exception as e:  # noqa: BLE001 - an unknown env or kwargs: show the record without a re-play
        return [], None, f"could not re-play {env_id} seed {seed}: {type(e).__name__}: {e}"


def _parse(response: str, prompt_format: str | None) -> dict[str, str | None]:
    from worldloop.envs.parsing import PROMPT_FORMATS, parse_response

    if prompt_format not in PROMPT_FORMATS:
        return {}
    p = parse_response(response, prompt_format)
    return {"observation": p.observation, "reasoning": p.reasoning, "prediction": p.prediction}


def episode_view(rec: dict, base_dir: Path, n: int, replay: bool = True) -> EpisodeView:
    settings = rec.get("settings") if isinstance(rec.get("settings"), dict) else {}
    kwargs = rec.get("env_kwargs") if isinstance(rec.get("env_kwargs"), dict) else {}
    prompt_format = _text(rec.get("prompt_format")) or _text(settings.get("prompt_format")) or _text(
        kwargs.get("prompt_format"))
    state_format = (_text(settings.get("state_format")) or _text(kwargs.get("state_format"))
                    or "natural_language")
    turns_in = [t for t in rec.get("turns") or [] if isinstance(t, dict)]
    responses = [_text(t.get("response")) or _text(t.get("response_text")) or "" for t in turns_in]
    ep = EpisodeView(
        anchor=f"ep{n}", env=_text(rec.get("env")) or _text(rec.get("env_name")) or _text(rec.get("env_id")) or "?",
        env_id=_text(rec.get("env_id")), seed=rec.get("seed"), success=bool(rec.get("success")),
        total_reward=0.0, model=_text(rec.get("model")), policy_version=rec.get("policy_version"),
        ident=_text(rec.get("trajectory_id")) or _text(rec.get("key")), end_reason=_text(rec.get("end_reason")),
        error=_text(rec.get("error")), prompt_format=prompt_format, state_format=state_format)

    def has_images(t: dict) -> bool:
        return isinstance(t.get("images"), list) and any(isinstance(i, str) for i in t["images"])

    needs = [not has_images(t) or not isinstance(t.get("state_before"), dict) for t in turns_in]
    played: list[dict] = []
    env = None
    if replay and turns_in and any(needs):
        played, env, why = _replay(rec, responses)
        if why and rec.get("env_id") is not None:
            ep.notes.append(why)
    total = 0.0
    for i, t in enumerate(turns_in):
        rp = played[i] if i < len(played) else None
        tv = _turn_view(t, i, responses[i], prompt_format, state_format, base_dir, rp, env)
        if rp is None and replay and needs[i] and played:
            tv.notes.append("the re-play ended before this turn")
        total += tv.rewards["total"]
        ep.turns.append(tv)
    if ep.policy_version is None:  # a trajectory records the version per turn
        versions = sorted({t["policy_version"] for t in turns_in if isinstance(t.get("policy_version"), int)})
        if versions:
            ep.policy_version = str(versions[0]) if len(versions) == 1 else f"{versions[0]}-{versions[-1]}"
    rec_total = _num(rec.get("total_reward"))
    ep.total_reward = rec_total if rec_total is not None else round(total, 6)
    return ep


def _turn_view(t: dict, i: int, response: str, prompt_format: str | None, state_format: str, base_dir: Path,
               rp: dict | None, env: Any) -> TurnView:
    """One recorded turn, its missing images and true states taken from the re-played turn ``rp``
    (None: not re-played)."""
    tv = TurnView(index=int(t["index"]) if isinstance(t.get("index"), int) else i, response=response)
    tv.prompt = _text(t.get("prompt"))
    parsed = _parse(response, prompt_format) if any(t.get(k) is None for k in
                                                    ("observation", "prediction", "reasoning")) else {}
    for k in ("observation", "reasoning", "prediction"):
        setattr(tv, k, _text(t.get(k)) if t.get(k) is not None else parsed.get(k))
    tv.actions = [str(a) for a in t.get("actions") or []]
    tv.format_ok = t.get("format_ok") if isinstance(t.get("format_ok"), bool) else None
    tv.reason = _text(t.get("reason"))
    tv.done, tv.success = bool(t.get("done")), bool(t.get("success"))
    images = [u for u in (image_url(x, base_dir) for x in (t.get("images") if isinstance(t.get("images"), list)
                                                             else [t.get("image")])) if u]
    if not images and rp is not None and rp["image"] is not None:
        url = array_url(rp["image"])
        images = [url] if url else []
    tv.images = images
    sb = t.get("state_before") if isinstance(t.get("state_before"), dict) else (rp or {}).get("state_before")
    sa = t.get("state_after") if isinstance(t.get("state_after"), dict) else (rp or {}).get("state_after")
    tv.state_before, tv.state_after = describe(sb, state_format, env), describe(sa, state_format, env)
    tv.rewards = _turn_rewards(t)
    for name, key in (("grounding", "grounding_score"), ("world model", "worldmodeling_score")):
        v = _num(t.get(key))
        if v is not None:
            tv.scores[name] = v
    judge = t.get("judge") if isinstance(t.get("judge"), dict) else None
    tv.judge = judge or None
    if rp is not None:
        rec_r = _num(t.get("reward"))
        if rec_r is not None and abs(rec_r - rp["reward"]) > 1e-6 or (t.get("actions") is not None
                                                                     and tv.actions != rp["actions"]):
            tv.notes.append(f"re-play differs from the record at this turn (re-played reward {rp['reward']:g}, "
                            f"actions {', '.join(rp['actions']) or 'none'}): images and true states after it "
                            "may not be what the agent saw")
    return tv


def _turn_rewards(t: dict) -> dict[str, float]:
    """The turn's reward components as recorded, and its total (recorded, or their sum)."""
    env_r, fmt_r, judge_r = _num(t.get("env_reward")), _num(t.get("format_reward")), _num(t.get("reasoning_reward"))
    turn_total = _num(t.get("reward"))
    if turn_total is None:
        turn_total = sum(x for x in (env_r, fmt_r, judge_r) if x is not None)
    return {k: v for k, v in (("env", env_r), ("format", fmt_r), ("judge", judge_r), ("total", turn_total))
            if v is not None}


# --------------------------------------------------------------------------- HTML


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt(x: float) -> str:
    return f"{x:+.3g}" if x else "0"


def _box(title: str, text: str | None, mono: bool, cls: str = "") -> str:
    """A titled text box: monospace for grids and JSON, prose for sentences."""
    body = ((f"<pre>{_e(text)}</pre>" if mono else f'<p class="prose">{_e(text)}</p>') if text
            else '<p class="empty">not given</p>')
    return f'<div class="box {cls}"><h3>{_e(title)}</h3>{body}</div>'


def _judge_details(judge: dict) -> str:
    rows = []
    for k, v in judge.items():
        s = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)
        rows.append(f"<dt>{_e(k)}</dt><dd>{_e(s if len(s) <= 300 else s[:300] + ' …')}</dd>")
    full = json.dumps(judge, ensure_ascii=False, indent=1, default=str)
    more = (f"<details><summary>all judge details</summary><pre>{_e(full)}</pre></details>"
            if len(full) > 300 else "")
    return f'<dl>{"".join(rows)}</dl>{more}'


def _size_attrs(url: str) -> str:
    """width/height of a PNG data URL (no layout shift while it decodes) and the crisp up-scaling of
    small pixel-art images (grid envs); "" for other formats."""
    try:
        head = base64.b64decode(url.split(",", 1)[1][:44])
    except (binascii.Error, ValueError, IndexError):
        return ""
    if not head.startswith(b"\x89PNG") or len(head) < 24:
        return ""
    w, h = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    return f' width="{w}" height="{h}"' + (' class="px"' if max(w, h) < 240 else "")


def _turn_html(t: TurnView, ep: EpisodeView) -> str:
    figs = "".join(f'<figure><img src="{u}"{_size_attrs(u)} alt="image {j + 1} before turn {t.index}"></figure>'
                   for j, u in enumerate(t.images))
    media = figs or '<div class="none">no image (text observation)</div>'
    status = ('<span class="badge ok">format ok</span>' if t.format_ok else
              f'<span class="badge bad">format error</span> <span class="muted">{_e(t.reason or "")}</span>'
              if t.format_ok is False else "")
    flags = " ".join(x for x in ('<span class="chip">done</span>' if t.done else "",
                                  '<span class="chip"><b>success</b></span>' if t.success else "") if x)
    acts = "".join(f'<span class="chip action">{_e(a)}</span>' for a in t.actions) or '<span class="muted">none</span>'
    rewards = "".join(f'<span class="chip reward">{_e(k)} <b>{_fmt(v)}</b></span>' for k, v in t.rewards.items())
    mono = ep.state_format in ("symbolic", "structured")
    scores = "".join(f'<span class="chip">{_e(k)} <b>{v:.3g}</b></span>' for k, v in t.scores.items())
    judge = ""
    if t.scores or t.judge:
        judge = f'<div class="judge"><h3>Judge</h3><div class="facts">{scores}</div>'
        judge += (_judge_details(t.judge) if t.judge else "") + "</div>"
    notes = "".join(f'<p class="note">{_e(n)}</p>' for n in t.notes)
    prompt = (f"<details><summary>prompt</summary><pre>{_e(t.prompt)}</pre></details>" if t.prompt else "")
    reasoning = (f'<div class="box"><h3>Reasoning</h3><p class="prose">{_e(t.reasoning)}</p></div>' if t.reasoning else "")
    return f"""
<section class="turn" id="{ep.anchor}-t{t.index}">
<div class="turn-head"><strong>Turn {t.index}</strong>{status}{flags}</div>
<div class="media">{media}</div>
<div class="text">
<div class="pair">{_box("Agent's <observation>", t.observation, mono)}{_box("True state before the turn", t.state_before, mono, "truth")}</div>
<div class="pair">{_box("Agent's <prediction>", t.prediction, mono)}{_box("True state after the turn", t.state_after, mono, "truth")}</div>
{reasoning}
<div class="facts"><h3>Actions</h3>{acts}</div>
<div class="facts"><h3>Rewards</h3>{rewards or '<span class="muted">none recorded</span>'}</div>
{judge}{notes}
<details><summary>full response</summary><pre>{_e(t.response) if t.response else "(empty)"}</pre></details>
{prompt}
</div>
</section>"""


def _episode_html(ep: EpisodeView) -> str:
    badge = '<span class="badge ok">success</span>' if ep.success else '<span class="badge bad">no success</span>'
    meta = [f"seed {_e(ep.seed)}", f"total reward <b>{ep.total_reward:.4g}</b>", f"{len(ep.turns)} turn(s)"]
    if ep.end_reason:
        meta.append(f"ended: {_e(ep.end_reason)}")
    if ep.model:
        meta.append(f"model {_e(ep.model)}")
    if ep.policy_version is not None:
        meta.append(f"policy v{_e(ep.policy_version)}")
    if ep.prompt_format:
        meta.append(f"{_e(ep.prompt_format)} / {_e(ep.state_format)}")
    env_id = f' <span class="muted">{_e(ep.env_id)}</span>' if ep.env_id and ep.env_id != ep.env else ""
    failure = f'<p class="failure">episode error: {_e(ep.error)}</p>' if ep.error else ""
    notes = "".join(f'<p class="note">{_e(n)}</p>' for n in ep.notes)
    turns = "".join(_turn_html(t, ep) for t in ep.turns) or '<p class="muted">no turns were played</p>'
    return f"""
<article class="episode" id="{ep.anchor}">
<header><h2>{_e(ep.env)}{env_id}</h2>{badge}<span class="muted">{" · ".join(meta)}</span></header>
{failure}{notes}{turns}
</article>"""


def render_page(episodes: list[EpisodeView], source: str, skipped: int = 0, dropped: int = 0) -> str:
    n = len(episodes)
    wins = sum(e.success for e in episodes)
    mean = sum(e.total_reward for e in episodes) / n if n else 0.0
    rows = "".join(
        f'<tr><td><a href="#{e.anchor}">{_e(e.env)}</a></td><td class="num">{_e(e.seed)}</td>'
        f'<td>{"yes" if e.success else "no"}</td><td class="num">{e.total_reward:.4g}</td>'
        f'<td class="num">{len(e.turns)}</td></tr>' for e in episodes)
    extra = []
    if skipped:
        extra.append(f'<span class="note">{skipped} unreadable line(s) skipped</span>')
    if dropped:
        extra.append(f'<span class="note">{dropped} more episode(s) not shown (--max-episodes)</span>')
    toc = (f'<table class="toc"><thead><tr><th>env</th><th class="num">seed</th><th>success</th>'
           f'<th class="num">total reward</th><th class="num">turns</th></tr></thead><tbody>{rows}</tbody></table>'
           if episodes else '<p class="muted">no episodes in this file</p>')
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'">
<title>worldloop episodes: {_e(Path(source).name)}</title>
<style>{_CSS}</style></head>
<body><main>
<h1>worldloop episodes</h1>
<p class="muted">{_e(source)}</p>
<div class="summary"><span><b>{n}</b> episode(s)</span><span>success <b>{wins}/{n}</b></span>
<span>mean total reward <b>{mean:.4g}</b></span>{"".join(extra)}</div>
{toc}
{"".join(_episode_html(e) for e in episodes)}
</main></body></html>
"""


def build_page(path: Path, max_episodes: int = DEFAULT_MAX_EPISODES, replay: bool = True) -> str:
    records, skipped, file = read_records(path)
    shown = records[: max(0, max_episodes)]
    views = [episode_view(r, file.parent, i, replay=replay) for i, r in enumerate(shown)]
    return render_page(views, str(file), skipped, len(records) - len(shown))


def default_out(path: Path) -> Path:
    path = Path(path)
    return path / "episodes.html" if path.is_dir() else path.with_suffix(".html")


def write_page(path: Path, out: Path | None = None, max_episodes: int = DEFAULT_MAX_EPISODES) -> Path:
    out = Path(out) if out else default_out(path)
    page = build_page(path, max_episodes)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out


def run(cfg: Any, args: argparse.Namespace) -> int:
    """The ``worldloop show`` entry point (needs no config)."""
    try:
        out = write_page(Path(args.path), getattr(args, "out", None),
                         getattr(args, "max_episodes", DEFAULT_MAX_EPISODES) or DEFAULT_MAX_EPISODES)
    except FileNotFoundError as e:
        print(f"worldloop show: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
