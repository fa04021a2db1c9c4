// Console behaviour, loaded as a file (the Content-Security-Policy forbids inline scripts).
(function () {
  "use strict";

  function csrfToken() {
    var meta = document.querySelector('meta[name="csrf-token"]');
    return meta ? meta.getAttribute("content") : "";
  }

  // htmx requests carry the session's CSRF token, as forms do in a hidden field.
  document.addEventListener("htmx:configRequest", function (event) {
    event.detail.headers["X-CSRF-Token"] = csrfToken();
  });

  function brandColor() {
    return getComputedStyle(document.documentElement).getPropertyValue("--brand").trim() || "#2f5bea";
  }

  function series(kind) {
    if (kind === "latency") {
      return [
        {},
        { label: "p50 ms", stroke: brandColor(), width: 2 },
        { label: "p99 ms", stroke: "#d9480f", width: 2 },
      ];
    }
    return [
      {},
      { label: "succeeded", stroke: "#2b8a3e", fill: "rgba(43,138,62,0.15)", width: 2 },
      { label: "failed", stroke: "#c92a2a", fill: "rgba(201,42,42,0.15)", width: 2 },
    ];
  }

  function columns(kind, data) {
    if (kind === "latency") {
      return [data.minutes, data.p50_ms, data.p99_ms];
    }
    return [data.minutes, data.succeeded, data.failed];
  }

  function draw(element) {
    var kind = element.getAttribute("data-chart");
    fetch(element.getAttribute("data-src"), { credentials: "same-origin" })
      .then(function (response) { return response.json(); })
      .then(function (data) {
        element.textContent = "";
        element.setAttribute("data-points", String(data.minutes.length));
        if (!data.minutes.length) {
          element.textContent = "No attempts in this period.";
          return;
        }
        var options = {
          width: Math.max(element.clientWidth, 320),
          height: 180,
          series: series(kind),
          axes: [{}, { size: 50 }],
        };
        var chart = new uPlot(options, columns(kind, data), element);
        element.setAttribute("data-rendered", "true");
        element.chart = chart;
      })
      .catch(function (error) {
        element.textContent = "Chart unavailable: " + error;
      });
  }

  function drawAll() {
    document.querySelectorAll("[data-chart]").forEach(draw);
  }

  document.addEventListener("DOMContentLoaded", function () {
    drawAll();
    // Live: redraw the charts every minute.
    if (document.querySelector("[data-chart]")) {
      setInterval(drawAll, 60000);
    }
  });
})();
