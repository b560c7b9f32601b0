// kvsplice dashboard: re-fetch the server-rendered panels and plot each namespace's
// token hit rate over time. No libraries, nothing from the internet.
(function () {
  "use strict";
  var HISTORY = 150; // points kept per namespace (5 minutes at 2 s)
  var COLORS = ["#3b73d9", "#d9453b", "#2f9e55", "#c98a0c", "#8a4fd1", "#1597a8", "#d1459b", "#6b7280"];
  var history = {}; // namespace -> [rate or null, ...]
  var colorOf = {};
  var refreshMs = Number(document.body.dataset.refreshMs) || 2000;

  function sample() {
    var rows = document.querySelectorAll("#namespaces tr.ns");
    for (var i = 0; i < rows.length; i++) {
      var ns = rows[i].dataset.namespace;
      var raw = rows[i].dataset.hitRate;
      if (!(ns in colorOf)) colorOf[ns] = COLORS[Object.keys(colorOf).length % COLORS.length];
      var points = history[ns] || (history[ns] = []);
      points.push(raw === "" ? null : Number(raw));
      if (points.length > HISTORY) points.shift();
    }
    draw();
  }

  function draw() {
    var svg = document.getElementById("chart");
    var legend = document.getElementById("legend");
    var parts = ['<line x1="34" y1="150" x2="600" y2="150" stroke="#ccd" />',
      '<line x1="34" y1="10" x2="600" y2="10" stroke="#eef" />',
      '<text class="axis" x="0" y="154">0%</text>', '<text class="axis" x="0" y="14">100%</text>'];
    var names = Object.keys(history).sort();
    var legendHtml = "";
    names.forEach(function (ns) {
      var points = history[ns], coords = [];
      var span = Math.max(points.length - 1, 1); // the oldest sample at the left edge
      points.forEach(function (rate, i) {
        if (rate === null) return;
        coords.push((36 + 562 * i / span).toFixed(1) + "," + (150 - 140 * rate).toFixed(1));
      });
      if (coords.length) {
        parts.push('<polyline fill="none" stroke-width="2" stroke="' + colorOf[ns] + '" points="' + coords.join(" ") + '" />');
      }
      var last = points[points.length - 1];
      legendHtml += '<span style="color:' + colorOf[ns] + '">&#9632; ' + escapeHtml(ns) + " " +
        (last === null || last === undefined ? "-" : (100 * last).toFixed(1) + "%") + "</span>";
    });
    svg.innerHTML = parts.join("");
    legend.innerHTML = legendHtml || "no namespace yet (0% at the bottom, 100% at the top)";
  }

  function escapeHtml(text) {
    return text.replace(/[&<>"]/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c];
    });
  }

  function refresh() {
    fetch("/dashboard/panels", { credentials: "same-origin", cache: "no-store" })
      .then(function (reply) {
        if (!reply.ok) throw new Error("HTTP " + reply.status);
        return reply.text();
      })
      .then(function (html) {
        document.getElementById("panels").innerHTML = html;
        document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
        sample();
      })
      .catch(function (error) {
        document.getElementById("updated").textContent = "refresh failed: " + error.message;
      })
      .finally(function () { setTimeout(refresh, refreshMs); });
  }

  sample();
  setTimeout(refresh, refreshMs);
})();
