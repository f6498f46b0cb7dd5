// redisdask dashboard: each section with data-live follows its fragment over server-sent
// events and swaps in each new rendering (escaped by the server; no other script runs).
"use strict";

function follow(section) {
  const source = new EventSource(section.dataset.live);
  const dot = document.getElementById("connection");
  source.addEventListener("html", (event) => {
    const logs = section.querySelector("pre[data-follow]");
    const atBottom = !logs || logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
    section.innerHTML = event.data;
    const fresh = section.querySelector("pre[data-follow]");
    if (fresh && atBottom) fresh.scrollTop = fresh.scrollHeight;
    section.dataset.updated = String(Date.now());
    if (dot) dot.className = "connection live";
  });
  source.onerror = () => { if (dot) dot.className = "connection lost"; };
}

document.querySelectorAll("section[data-live]").forEach(follow);
document.querySelectorAll("pre[data-follow]").forEach((pre) => { pre.scrollTop = pre.scrollHeight; });
