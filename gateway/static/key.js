// The API key for this browser tab. The gateway says whether it wants one (/dashboard/auth);
// a key typed here stays in sessionStorage (gone with the tab) and goes out as a bearer header
// on fetch(), never in a URL.
"use strict";

const MatineeKey = (() => {
  const STORE = "matinee-api-key";
  let required = null;

  async function isRequired() {
    if (required === null) {
      const r = await fetch("/dashboard/auth", {cache: "no-store"});
      required = (await r.json()).key_required;
    }
    return required;
  }

  function headers(extra) {
    const key = sessionStorage.getItem(STORE);
    return Object.assign({}, extra || {}, key ? {Authorization: "Bearer " + key} : {});
  }

  // Shows the key form; resolves once a key was entered.
  function ask(message) {
    const form = document.getElementById("key-form");
    document.getElementById("key-message").textContent = message || "This server wants its API key.";
    form.hidden = false;
    const input = form.querySelector("input");
    input.focus();
    return new Promise((resolve) => {
      form.onsubmit = (ev) => {
        ev.preventDefault();
        sessionStorage.setItem(STORE, input.value.trim());
        form.hidden = true;
        resolve();
      };
    });
  }

  // A fetch with the key; asks for one first when the server wants it and none is stored, and
  // again when the server refuses the one given.
  async function fetchWithKey(url, options) {
    if (await isRequired() && !sessionStorage.getItem(STORE)) await ask();
    for (;;) {
      const r = await fetch(url, Object.assign({}, options, {headers: headers((options || {}).headers)}));
      if (r.status !== 401) return r;
      sessionStorage.removeItem(STORE);
      await ask("That key was refused; try again.");
    }
  }

  return {fetch: fetchWithKey};
})();
