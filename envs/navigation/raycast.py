"""A small vectorised ray caster (numpy only) for scenes made of axis-aligned boxes and spheres.

Used by the Navigation env (first-person views of a room) and by the PrimitiveSkill tabletop
renderer (third-person view of the table). One ray per pixel; every stage is a whole-array numpy
operation (no per-pixel Python loop), so a 255 x 255 frame of ~40 boxes costs a few tens of ms.

Conventions: right-handed world with **y up**. A camera at ``eye`` with ``yaw`` (degrees, 0 looks
along +z, 90 along +x: "rotate right" increases yaw, as AI2-THOR's rotation.y) and ``pitch``
(degrees, positive looks *down*, as AI2-THOR's camera horizon). ``fov`` is the full field of view
across the image side (square images; for other shapes it applies to the height).

Public API::

    Scene(room_lo, room_hi, *, wall_colors, floor_color, ceiling_color, floor_tile=0.5,
          decals=())                               # the interior of the room AABB is the world
    scene.add_box(lo, hi, color, oid)              # an axis-aligned box, oid >= 1 names its object
    scene.add_sphere(center, radius, color, oid)
    scene.render(eye, yaw, pitch, fov, width, height=None, shade=True)
        -> Frame(rgb uint8 [H, W, 3], ids int32 [H, W] (0 = room surfaces), depth float32 [H, W])
    camera_rays(yaw, pitch, fov, width, height) -> float32 [H*W, 3] unit directions
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

_EPS = 1e-6
_LIGHT = np.array([0.35, 0.85, -0.4], dtype=np.float32)
_LIGHT /= np.linalg.norm(_LIGHT)


@dataclass
class Frame:
    """One rendered view: colour image, object id per pixel (0 = room/table) and hit distance."""

    rgb: np.ndarray
    ids: np.ndarray
    depth: np.ndarray

    def visible_ids(self, min_pixels: int = 1) -> dict[int, int]:
        """``{object id: pixel count}`` of objects covering at least ``min_pixels`` pixels."""
        ids, counts = np.unique(self.ids[self.ids > 0], return_counts=True)
        return {int(i): int(c) for i, c in zip(ids, counts) if c >= min_pixels}


@lru_cache(maxsize=32)
def _camera_grid(fov: float, width: int, height: int) -> np.ndarray:
    """Camera-space ray directions (x right, y up, z forward) before rotation: [H*W, 3]."""
    half = math.tan(math.radians(fov) / 2.0)
    xs = ((np.arange(width, dtype=np.float32) + 0.5) / width * 2.0 - 1.0) * half * (width / height)
    ys = -((np.arange(height, dtype=np.float32) + 0.5) / height * 2.0 - 1.0) * half
    gx, gy = np.meshgrid(xs, ys)
    grid = np.stack([gx, gy, np.ones_like(gx)], axis=-1).reshape(-1, 3)
    grid.setflags(write=False)
    return grid


@lru_cache(maxsize=64)
def _ray_setup(yaw: float, pitch: float, fov: float, width: int, height: int):
    """Rays, their components and reciprocal components for one camera pose (cached, read-only)."""
    d = camera_rays(yaw, pitch, fov, width, height)
    dc = [np.ascontiguousarray(d[:, ax]) for ax in range(3)]
    inv = [1.0 / np.where(np.abs(c) < _EPS, np.where(c < 0, -_EPS, _EPS), c).astype(np.float32) for c in dc]
    for a in [d, *dc, *inv]:
        a.setflags(write=False)
    return d, dc, inv


def camera_rays(yaw: float, pitch: float, fov: float, width: int, height: int) -> np.ndarray:
    """Unit world-space ray directions [H*W, 3] for a camera with the given yaw/pitch (degrees)."""
    grid = _camera_grid(float(fov), int(width), int(height))
    p, y = math.radians(pitch), math.radians(yaw)
    # camera axes in world space: pitch about the camera x axis (down positive), then yaw about +y
    fwd = np.array([math.sin(y) * math.cos(p), -math.sin(p), math.cos(y) * math.cos(p)], np.float32)
    up = np.array([math.sin(y) * math.sin(p), math.cos(p), math.cos(y) * math.sin(p)], np.float32)
    right = np.array([math.cos(y), 0.0, -math.sin(y)], np.float32)
    d = grid @ np.stack([right, up, fwd])
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    return d


class Scene:
    """Boxes and spheres inside a room (an AABB whose inner faces are walls, floor and ceiling).

    ``decals`` are discs painted on the floor: ``(x, z, radius, colors)`` where ``colors`` is a list
    of RGB rings from the outside in (a red/white target is ``[(200,30,30), (240,240,240), ...]``).
    """

    def __init__(self, room_lo, room_hi, *, wall_colors=((200, 195, 185),) * 4,
                 floor_color=(150, 120, 90), ceiling_color=(235, 235, 235), floor_tile: float = 0.5,
                 decals=()):
        self.room_lo = np.asarray(room_lo, np.float32)
        self.room_hi = np.asarray(room_hi, np.float32)
        # walls in order: -x, +x, -z, +z
        self.wall_colors = np.asarray(wall_colors, np.float32).reshape(4, 3)
        self.floor_color = np.asarray(floor_color, np.float32)
        self.ceiling_color = np.asarray(ceiling_color, np.float32)
        self.floor_tile = float(floor_tile)
        self.decals = list(decals)
        self._lo: list[np.ndarray] = []
        self._hi: list[np.ndarray] = []
        self._bcol: list[np.ndarray] = []
        self._bid: list[int] = []
        self._sc: list[np.ndarray] = []
        self._sr: list[float] = []
        self._scol: list[np.ndarray] = []
        self._sid: list[int] = []

    def add_box(self, lo, hi, color, oid: int) -> None:
        lo, hi = np.asarray(lo, np.float32), np.asarray(hi, np.float32)
        if np.any(hi <= lo):
            raise ValueError(f"box must have positive size: lo={lo.tolist()} hi={hi.tolist()}")
        self._lo.append(lo)
        self._hi.append(hi)
        self._bcol.append(np.asarray(color, np.float32))
        self._bid.append(int(oid))

    def add_sphere(self, center, radius: float, color, oid: int) -> None:
        self._sc.append(np.asarray(center, np.float32))
        self._sr.append(float(radius))
        self._scol.append(np.asarray(color, np.float32))
        self._sid.append(int(oid))

    # ------------------------------------------------------------------ rendering

    @staticmethod
    def _cast_boxes(o, yaw, pitch, fov, width, height, inv, lo, hi, t_best, box_index):
        """Nearest box entry per ray, testing each box only on the pixels of its screen bounds.

        ``inv`` is a tuple of three [H, W] arrays (1 / ray direction per axis); ``t_best`` and
        ``box_index`` are [H, W] arrays updated in place.
        """
        p, y = math.radians(pitch), math.radians(yaw)
        fwd = np.array([math.sin(y) * math.cos(p), -math.sin(p), math.cos(y) * math.cos(p)])
        up = np.array([math.sin(y) * math.sin(p), math.cos(p), math.cos(y) * math.sin(p)])
        right = np.array([math.cos(y), 0.0, -math.sin(y)])
        half = math.tan(math.radians(fov) / 2.0)
        aspect = width / height
        corners = np.stack(np.meshgrid([0, 1], [0, 1], [0, 1], indexing="ij"), -1).reshape(8, 3)
        pts = np.where(corners[None, :, :] == 0, lo[:, None, :], hi[:, None, :]) - o  # [B, 8, 3]
        cz = pts @ fwd
        cx = pts @ right
        cy = pts @ up
        rel_lo = (lo - o).astype(np.float32)
        rel_hi = (hi - o).astype(np.float32)
        for k in range(lo.shape[0]):
            z = cz[k]
            if np.all(z <= 1e-3):
                continue  # entirely behind the camera
            if np.all(z > 1e-3):
                u = cx[k] / z / (half * aspect)
                v = cy[k] / z / half
                c0 = int(max(0, math.floor((u.min() + 1) / 2 * width) - 1))
                c1 = int(min(width, math.ceil((u.max() + 1) / 2 * width) + 1))
                r0 = int(max(0, math.floor((1 - v.max()) / 2 * height) - 1))
                r1 = int(min(height, math.ceil((1 - v.min()) / 2 * height) + 1))
                if c0 >= c1 or r0 >= r1:
                    continue
            else:
                c0, c1, r0, r1 = 0, width, 0, height
            t_near = t_exit = None
            for ax in range(3):
                iv = inv[ax][r0:r1, c0:c1]
                a = rel_lo[k, ax] * iv
                b = rel_hi[k, ax] * iv
                if t_near is None:
                    t_near, t_exit = np.minimum(a, b), np.maximum(a, b)
                else:
                    np.maximum(t_near, np.minimum(a, b), out=t_near)
                    np.minimum(t_exit, np.maximum(a, b), out=t_exit)
            cur = t_best[r0:r1, c0:c1]
            win = (t_exit >= t_near) & (t_near > _EPS) & (t_near < cur)
            cur[win] = t_near[win]
            box_index[r0:r1, c0:c1][win] = k

    def render(self, eye, yaw: float, pitch: float, fov: float, width: int,
               height: int | None = None, shade: bool = True) -> Frame:
        """The view from ``eye``: each ray's nearest hit among the room shell, the boxes and the
        spheres, coloured (floor tiles, decals, box outlines), lit by one directional light and fogged."""
        height = int(height or width)
        width = int(width)
        o = np.asarray(eye, np.float32)
        d, dc, inv = _ray_setup(float(yaw), float(pitch), float(fov), width, height)
        n = d.shape[0]

        # --- the room shell: exit distance of each ray through the room AABB
        far = [np.maximum((self.room_lo[ax] - o[ax]) * inv[ax], (self.room_hi[ax] - o[ax]) * inv[ax])
               for ax in range(3)]
        t_best = np.minimum(np.minimum(far[0], far[1]), far[2])
        room_axis = np.where(far[0] <= np.minimum(far[1], far[2]), 0, np.where(far[1] <= far[2], 1, 2))
        box_index = np.full(n, -1, np.int64)

        # --- boxes: a slab test restricted to the screen rectangle each box projects to
        if self._lo:
            lo = np.stack(self._lo)
            hi = np.stack(self._hi)
            self._cast_boxes(o, yaw, pitch, fov, width, height,
                             [v.reshape(height, width) for v in inv], lo, hi,
                             t_best.reshape(height, width), box_index.reshape(height, width))
        t_best, box_index, sphere_index = self._cast_spheres(o, d, t_best, box_index)

        px = o[0] + dc[0] * t_best
        pz = o[2] + dc[2] * t_best
        # lambert term of the surface normal; room faces and box faces have axis normals
        light_axis = np.where(room_axis == 0, -np.sign(dc[0]) * _LIGHT[0],
                              np.where(room_axis == 1, -np.sign(dc[1]) * _LIGHT[1],
                                       -np.sign(dc[2]) * _LIGHT[2]))
        color = self._room_colors(px, pz, dc, room_axis, (box_index < 0) & (sphere_index < 0))
        ids = np.zeros(n, np.int32)
        if self._lo:
            self._color_boxes(o, dc, inv, t_best, box_index, lo, hi, color, light_axis, ids)
        if self._sc:
            self._color_spheres(o, d, t_best, sphere_index, color, light_axis, ids)

        if shade:
            light = 0.55 + 0.45 * np.clip(light_axis, 0.0, 1.0)
            fog = np.exp(-0.04 * np.maximum(t_best, 0.0))
            color = color * (light * fog)[:, None] + (1.0 - fog)[:, None] * 40.0
        rgb = np.clip(color, 0, 255).astype(np.uint8).reshape(height, width, 3)
        return Frame(rgb=rgb, ids=ids.reshape(height, width),
                     depth=t_best.astype(np.float32).reshape(height, width))

    def _cast_spheres(self, o, d, t_best, box_index):
        """(t_best, box_index, sphere_index) after the spheres: where a sphere is nearer than the
        shell or box hit so far, its distance and index (and no box)."""
        n = d.shape[0]
        sphere_index = np.full(n, -1, np.int64)
        if self._sc:
            c = np.stack(self._sc)
            r = np.asarray(self._sr, np.float32)
            oc = o[None, :] - c  # [S, 3]
            bq = d @ oc.T  # [N, S]
            cq = (oc * oc).sum(axis=1) - r * r
            disc = bq * bq - cq[None, :]
            ts = -bq - np.sqrt(np.maximum(disc, 0.0))
            ts = np.where((disc >= 0) & (ts > _EPS), ts, np.inf)
            sbest = np.argmin(ts, axis=1)
            tsb = ts[np.arange(n), sbest]
            closer = tsb < t_best
            t_best = np.where(closer, tsb, t_best)
            sphere_index = np.where(closer, sbest, -1)
            box_index = np.where(closer, -1, box_index)
        return t_best, box_index, sphere_index

    def _room_colors(self, px, pz, dc, room_axis, room) -> np.ndarray:
        """[N, 3] float colours of the room surfaces (walls, checkered floor, ceiling, floor decals)
        at the rays' hit points (px, pz); ``room`` marks the rays that hit the shell."""
        wall_idx = np.where(room_axis == 0, np.where(dc[0] < 0, 0, 1), np.where(dc[2] < 0, 2, 3))
        color = self.wall_colors[wall_idx]
        floor = room & (room_axis == 1) & (dc[1] < 0)
        ceil = room & (room_axis == 1) & (dc[1] >= 0)
        if self.floor_tile > 0:
            checker = (np.floor(px / self.floor_tile) + np.floor(pz / self.floor_tile)) % 2 == 0
            color[floor & checker] = self.floor_color
            color[floor & ~checker] = self.floor_color * 0.88
        else:
            color[floor] = self.floor_color
        color[ceil] = self.ceiling_color
        for x, z, radius, rings in self.decals:
            dist = np.hypot(px - x, pz - z)
            k = len(rings)
            for i, ring in enumerate(rings):
                inside = floor & (dist <= radius * (k - i) / k)
                color[inside] = ring
        return color

    def _color_boxes(self, o, dc, inv, t_best, box_index, lo, hi, color, light_axis, ids) -> None:
        """Colour, light term and object id of the rays that hit a box (in place), with a dark outline
        along the box edges."""
        sel = np.flatnonzero(box_index >= 0)
        if not sel.size:
            return
        bi = box_index[sel]
        ts = t_best[sel]
        blo, bhi = lo[bi], hi[bi]
        near = []
        for ax in range(3):
            iv = inv[ax][sel]
            near.append(np.minimum((blo[:, ax] - o[ax]) * iv, (bhi[:, ax] - o[ax]) * iv))
        axis = np.where(near[0] >= np.maximum(near[1], near[2]), 0,
                        np.where(near[1] >= near[2], 1, 2))
        lam = np.zeros(sel.size, np.float32)
        outline = np.zeros(sel.size, bool)
        for ax in range(3):
            on = axis == ax
            lam[on] = -np.sign(dc[ax][sel][on]) * _LIGHT[ax]
            # dark outline along box edges: a local coordinate near a face boundary
            size = np.maximum(bhi[:, ax] - blo[:, ax], 1e-3)
            u = (o[ax] + dc[ax][sel] * ts - blo[:, ax]) / size
            ew = np.minimum(0.012 * ts / size, 0.25)
            outline |= ~on & ((u < ew) | (u > 1.0 - ew))
        light_axis[sel] = lam
        col = np.stack(self._bcol)[bi]
        col[outline] *= 0.45
        color[sel] = col
        ids[sel] = np.asarray(self._bid, np.int32)[bi]

    def _color_spheres(self, o, d, t_best, sphere_index, color, light_axis, ids) -> None:
        """Colour, light term (from the sphere's normal) and object id of the rays that hit a sphere."""
        sel = np.flatnonzero(sphere_index >= 0)
        if not sel.size:
            return
        si = sphere_index[sel]
        c = np.stack(self._sc)[si]
        pts = o[None, :] + d[sel] * t_best[sel][:, None]
        nrm = pts - c
        nrm /= np.maximum(np.linalg.norm(nrm, axis=1, keepdims=True), 1e-6)
        light_axis[sel] = nrm @ _LIGHT
        color[sel] = np.stack(self._scol)[si]
        ids[sel] = np.asarray(self._sid, np.int32)[si]
