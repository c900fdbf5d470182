// idem's console: its only script, served from the console's own route (its
// Content-Security-Policy allows no inline script). Every page works without it; with it:
//
// - the copy buttons beside long ids (the whole id is in the page either way: shortened
//   on screen, whole in the text and the `title`);
// - the pages whose <main> carries `data-live="SECONDS"` (the overview, the outbox) fetch
//   themselves again every SECONDS and put the new <main> in place of the old one, while
//   the tab is visible, not paused, and no text in it is selected. `#live` in the header
//   says when the figures are from, or that a refresh failed (the old figures stay).
(function () {
  "use strict";
  document.documentElement.classList.add("js");

  function copied(button) {
    button.textContent = "copied";
    setTimeout(function () { button.textContent = "copy"; }, 1200);
  }

  // Without the asynchronous clipboard (a page served over plain HTTP to another host):
  // a selected, off-screen text area and the older copy command.
  function copyBySelection(text) {
    var area = document.createElement("textarea");
    area.value = text;
    area.readOnly = true;
    area.className = "offscreen";
    document.body.appendChild(area);
    area.select();
    var done = false;
    try { done = document.execCommand("copy"); } catch (e) { done = false; }
    area.remove();
    return done;
  }

  document.addEventListener("click", function (event) {
    var button = event.target.closest ? event.target.closest("button.copy") : null;
    if (!button) { return; }
    var text = button.getAttribute("data-copy") || "";
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(
        function () { copied(button); },
        function () { if (copyBySelection(text)) { copied(button); } }
      );
    } else if (copyBySelection(text)) {
      copied(button);
    }
  });

  var main = document.querySelector("main[data-live]");
  var status = document.getElementById("live");
  if (!main || !status) { return; }
  var every = Math.max(1, Number(main.getAttribute("data-live")) || 5) * 1000;
  var paused = false;
  var label = document.createElement("span");
  var toggle = document.createElement("button");
  toggle.type = "button";
  toggle.textContent = "pause";
  toggle.addEventListener("click", function () {
    paused = !paused;
    toggle.textContent = paused ? "resume" : "pause";
    if (!paused) { refresh(); }
  });
  var at = status.getAttribute("data-at") || "";
  function say(text, failed) {
    label.textContent = text;
    status.classList.toggle("failed", !!failed);
  }
  say("live, every " + every / 1000 + " s · as of " + at);
  status.textContent = "";
  status.appendChild(label);
  status.appendChild(toggle);

  // Whether the operator has selected text in the page: replacing it would lose it.
  function selecting() {
    var selection = window.getSelection ? window.getSelection() : null;
    return !!selection && !selection.isCollapsed && main.contains(selection.anchorNode);
  }

  var running = false;
  function refresh() {
    if (running || paused || document.hidden || selecting()) { return; }
    running = true;
    fetch(window.location.href, { credentials: "same-origin", cache: "no-store", redirect: "error" })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (text) {
        var page = new DOMParser().parseFromString(text, "text/html");
        var fresh = page.querySelector("main[data-live]");
        if (!fresh) { throw new Error("not a live page"); }
        if (paused || selecting()) { return; }
        main.replaceChildren.apply(main, Array.prototype.map.call(fresh.childNodes, function (node) {
          return document.importNode(node, true);
        }));
        var freshStatus = page.getElementById("live");
        at = (freshStatus && freshStatus.getAttribute("data-at")) || at;
        say("live, every " + every / 1000 + " s · as of " + at);
      })
      .catch(function (error) {
        say("not refreshed (" + error.message + "): figures as of " + at, true);
      })
      .then(function () { running = false; });
  }
  setInterval(refresh, every);
  document.addEventListener("visibilitychange", function () {
    if (!document.hidden) { refresh(); }
  });
})();
