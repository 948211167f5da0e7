// A small time-series line chart on a canvas: several series, a few y ticks, the last minutes on x.
"use strict";

const PALETTE = ["#4cc9f0", "#f72585", "#b5e48c", "#ffb703", "#9d4edd", "#fb8500", "#80ffdb", "#e5e5e5"];

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 4, 5, 8, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// series: [{label, color, width, dash, points: [[t_seconds, value|null], ...]}]; opts: {spanS, max, format}
function drawChart(canvas, series, opts) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const left = 52, right = 10, top = 8, bottom = 20;
  const now = Date.now() / 1000, span = opts.spanS;
  let peak = 0;
  for (const s of series) for (const [, v] of s.points) if (v !== null && v > peak) peak = v;
  const max = opts.max !== undefined ? opts.max : niceMax(peak * 1.1);
  const x = (t) => left + (w - left - right) * (1 - (now - t) / span);
  const y = (v) => top + (h - top - bottom) * (1 - Math.min(v, max) / max);

  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const v = (max * i) / 4, yy = y(v);
    ctx.strokeStyle = i === 0 ? "#3a4150" : "#262b36";
    ctx.beginPath(); ctx.moveTo(left, yy); ctx.lineTo(w - right, yy); ctx.stroke();
    ctx.fillStyle = "#8a93a6"; ctx.textAlign = "right";
    ctx.fillText(opts.format(v), left - 6, yy);
  }
  ctx.textAlign = "center"; ctx.textBaseline = "top";
  for (let m = 0; m * 60 <= span; m++) {
    const xx = x(now - m * 60);
    ctx.fillText(m === 0 ? "now" : `-${m}m`, Math.max(left + 10, Math.min(w - right - 12, xx)), h - bottom + 5);
  }
  ctx.save();
  ctx.beginPath(); ctx.rect(left, top - 2, w - left - right, h - top - bottom + 4); ctx.clip();
  series.forEach((s) => {
    ctx.strokeStyle = s.color; ctx.lineWidth = s.width || 1.8; ctx.setLineDash(s.dash || []);
    ctx.beginPath();
    let pen = false;
    for (const [t, v] of s.points) {
      if (v === null || now - t > span) { pen = false; continue; }
      if (pen) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
      pen = true;
    }
    ctx.stroke();
  });
  ctx.restore();
}
