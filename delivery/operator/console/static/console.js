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
      return [data.buckets, data.p50_ms, data.p99_ms];
    }
    return [data.buckets, data.succeeded, data.failed];
  }

  // Counts step in whole numbers; latencies as uPlot chooses.
  function yAxis(kind) {
    var axis = { size: 50 };
    if (kind !== "latency") {
      axis.incrs = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 100000, 1000000];
    }
    return axis;
  }

  function chartWidth(element) {
    return Math.max(element.clientWidth, 200);
  }

  var RANGE_WORDS = { hour: "in the last hour", day: "in the last day" };

  // The server decides buckets, the x range (now - range to now) and the tick labels
  // (charts.py); this only draws them. Empty buckets are null: uPlot leaves a gap.
  function draw(element) {
    var kind = element.getAttribute("data-chart");
    fetch(element.getAttribute("data-src"), { credentials: "same-origin" })
      .then(function (response) { return response.json(); })
      .then(function (data) {
        if (element.chart) { element.chart.destroy(); element.chart = null; }
        element.textContent = "";
        element.setAttribute("data-points", String(data.points));
        element.setAttribute("data-x-from", String(data.from));
        element.setAttribute("data-x-to", String(data.to));
        if (!data.points) {
          var empty = document.createElement("p");
          empty.className = "empty";
          empty.textContent = "No attempts " + (RANGE_WORDS[data.range] || "in this period") + ".";
          element.appendChild(empty);
          element.setAttribute("data-rendered", "empty");
          return;
        }
        var labelAt = {};
        data.ticks.forEach(function (tick, i) { labelAt[tick] = data.labels[i]; });
        var options = {
          width: chartWidth(element),
          height: 180,
          tzDate: function (ts) { return uPlot.tzDate(new Date(ts * 1000), "Etc/UTC"); },
          series: series(kind).map(function (s, i) {
            return i === 0 ? s : Object.assign({ spanGaps: false, points: { show: true, size: 4 } }, s);
          }),
          scales: {
            x: { time: true, range: function () { return [data.from, data.to]; } },
            // Counts and latencies start at zero, so a small value does not look large.
            y: { range: function (u, min, max) { return [0, max > 0 ? max * 1.15 : 1]; } },
          },
          axes: [
            {
              splits: function () { return data.ticks; },
              // On a narrow chart, every other (or third...) label, so none overlap.
              values: function (u, splits) {
                var every = Math.max(1, Math.ceil((splits.length * 48) / Math.max(u.width - 60, 1)));
                var drawn = splits.map(function (tick, i) { return i % every ? "" : labelAt[tick] || ""; });
                element.setAttribute("data-x-labels", drawn.filter(Boolean).join(" "));
                return drawn;
              },
            },
            yAxis(kind),
          ],
        };
        element.chart = new uPlot(options, columns(kind, data), element);
        element.setAttribute("data-rendered", "true");
      })
      .catch(function (error) {
        element.textContent = "Chart unavailable: " + error;
      });
  }

  function drawAll() {
    document.querySelectorAll("[data-chart]").forEach(draw);
  }

  // The nav's "Menu" button (shown on narrow screens by console.css): a disclosure that
  // Enter or Space toggles like any button, and Escape closes, back on the button.
  var toggle = document.querySelector(".menu-toggle");
  var nav = toggle && document.getElementById(toggle.getAttribute("aria-controls"));
  if (toggle && nav) {
    var setOpen = function (open) {
      toggle.setAttribute("aria-expanded", String(open));
      nav.classList.toggle("open", open);
    };
    toggle.addEventListener("click", function () {
      setOpen(toggle.getAttribute("aria-expanded") !== "true");
    });
    toggle.parentElement.addEventListener("keydown", function (event) {
      if (event.key === "Escape" && toggle.getAttribute("aria-expanded") === "true") {
        setOpen(false);
        toggle.focus();
      }
    });
  }

  // A window made narrower or wider (a phone turned round) redraws each chart at its
  // card's new width, once a frame at most; the data stays.
  var resizePending = false;
  window.addEventListener("resize", function () {
    if (resizePending) { return; }
    resizePending = true;
    requestAnimationFrame(function () {
      resizePending = false;
      document.querySelectorAll("[data-chart]").forEach(function (element) {
        if (element.chart) {
          element.chart.setSize({ width: chartWidth(element), height: 180 });
        }
      });
    });
  });

  document.addEventListener("DOMContentLoaded", function () {
    drawAll();
    // Live: redraw the charts every minute.
    if (document.querySelector("[data-chart]")) {
      setInterval(drawAll, 60000);
    }
  });
})();
