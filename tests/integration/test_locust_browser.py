"""Locust's web UI in a real browser: headless Chromium logs in through the gateway, picks the
stepped shape and one user class in the start form, starts a run, reads the live statistics,
and stops it. With LOCUST_SCREENSHOTS_DIR=docs/images it refreshes the screenshots that
docs/loadtest.md shows (the command is there).

Chromium and its driver are Debian's `chromium` and `chromium-driver` (scripts/install-tools.sh).
"""

from __future__ import annotations

import base64
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait

USER_CLASS = "CompletionUser"
SHAPE_CLASS = "StepLoadShape"
SCREENSHOTS_DIR_SETTING = "LOCUST_SCREENSHOTS_DIR"
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000")
# The 2-core CI machine runs vLLM, nginx and Prometheus beside the browser: generous waits.
PAGE_TIMEOUT_S = 30
STATS_TIMEOUT_S = 45

# The statistics table, read in one pass inside the page: React re-renders it every poll, so
# elements found one by one can go stale between two reads.
READ_STATISTICS_TABLE = """
const table = [...document.querySelectorAll('table')].find(
    t => [...t.querySelectorAll('thead th')].some(th => th.textContent.trim() === '# Requests'));
if (!table) return null;
const headers = [...table.querySelectorAll('thead th')].map(th => th.textContent.trim());
return [...table.querySelectorAll('tbody tr')].map(
    tr => Object.fromEntries([...tr.cells].map((td, i) => [headers[i], td.textContent.trim()])));
"""


@pytest.fixture
def chromium() -> Iterator[webdriver.Chrome]:
    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not binary or not driver_path:
        # Never a skip: CI installs both, so a missing browser is a broken setup.
        pytest.fail(
            "headless Chromium is needed: install Debian's chromium and chromium-driver "
            f"(scripts/install-tools.sh); found chromium={binary}, chromedriver={driver_path}"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


class Screenshots:
    """Every screenshot goes to the test's tmp folder, and also to LOCUST_SCREENSHOTS_DIR when set."""

    def __init__(self, driver: WebDriver, tmp_path: Path):
        self.driver = driver
        self.folders = [tmp_path]
        if os.environ.get(SCREENSHOTS_DIR_SETTING):
            self.folders.append(Path(os.environ[SCREENSHOTS_DIR_SETTING]))

    def take(self, name: str) -> None:
        png = self.driver.get_screenshot_as_png()
        for folder in self.folders:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"locust-ui-{name}.png").write_bytes(png)


def log_in(driver: webdriver.Chrome, user: str, password: str) -> None:
    """Basic auth on every request the page makes, the React app's fetches included. Credentials in
    the URL load the page, but fetch() refuses URLs that carry them, so the app never renders; the
    BiDi auth handler timed out with this chromedriver. CDP's extra headers work in Chromium."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}})


def field_labelled(driver: WebDriver, label: str) -> WebElement:
    """The form control a visible label names (MUI labels point at their control with `for`)."""
    label_element = driver.find_element(By.XPATH, f"//label[starts-with(normalize-space(), '{label}')]")
    return driver.find_element(By.ID, label_element.get_attribute("for") or "")


def header_value(driver: WebDriver, title: str) -> str:
    """A value of the header bar (Status, Users, RPS...), as displayed (the UI upper-cases the status)."""
    return driver.find_element(By.XPATH, f"//header//p[normalize-space()='{title}']/following-sibling::*[1]").text


def header_button(driver: WebDriver, text: str) -> WebElement:
    return driver.find_element(By.XPATH, f"//header//button[normalize-space()='{text}']")


def statistics_table(driver: WebDriver) -> dict[tuple[str, str], dict[str, str]]:
    rows = driver.execute_script(READ_STATISTICS_TABLE) or []
    return {(row["Type"], row["Name"]): row for row in rows}


def pick_user_class(driver: WebDriver, wanted: str) -> list[str]:
    """Ticks only `wanted` in the start form's user class table; returns every class it offered."""
    rows = driver.find_elements(By.XPATH, f"//table[.//td[normalize-space()='{wanted}']]/tbody/tr")
    offered = []
    for row in rows:
        name = row.find_element(By.XPATH, "./td[2]").text.strip()
        offered.append(name)
        checkbox = row.find_element(By.XPATH, ".//input[@type='checkbox']")
        if checkbox.is_selected() != (name == wanted):
            checkbox.click()
    return offered


def locust_entries(stack) -> dict[tuple[str, str], dict]:
    """Locust's /stats/requests entries by (type, name), as the UI's table keys its rows."""
    return {(entry["method"] or "", entry["name"]): entry for entry in locust_json(stack, "stats/requests")["stats"]}


def locust_json(stack, path: str) -> dict:
    """Locust's own JSON, through the gateway with the same login."""
    response = requests.get(stack.url(f"/locust/{path}"), auth=("admin", stack.passwords["locust"]), timeout=30)
    response.raise_for_status()
    return response.json()


def wait_until_locust_idle(stack) -> None:
    deadline = time.monotonic() + 60
    while (state := locust_json(stack, "stats/requests")["state"]) not in ("ready", "stopped"):
        assert time.monotonic() < deadline, f"Locust still '{state}' after a minute"
        time.sleep(0.5)


@pytest.fixture
def idle_locust(stack) -> Iterator[None]:
    """Locust idle before the browser starts a run, and stopped with empty statistics after it,
    whatever happened in between, so later tests find the master as they expect."""
    wait_until_locust_idle(stack)
    yield
    auth = ("admin", stack.passwords["locust"])
    if locust_json(stack, "stats/requests")["state"] not in ("ready", "stopped"):
        requests.post(stack.url("/locust/stop"), auth=auth, timeout=30).raise_for_status()
    wait_until_locust_idle(stack)
    requests.post(stack.url("/locust/stats/reset"), auth=auth, timeout=30).raise_for_status()


def open_start_form(driver: WebDriver) -> WebElement:
    """The start form: on the first page while Locust never ran, behind "New" after a run."""
    start_heading = "//h2[normalize-space()='Start new load test']"
    new_button = "//header//button[normalize-space()='New']"
    WebDriverWait(driver, PAGE_TIMEOUT_S).until(lambda d: d.find_elements(By.XPATH, f"{start_heading} | {new_button}"))
    if not driver.find_elements(By.XPATH, start_heading):
        header_button(driver, "New").click()
    return WebDriverWait(driver, PAGE_TIMEOUT_S).until(
        lambda d: d.find_element(By.XPATH, "//form[.//button[@type='submit' and normalize-space()='Start']]")
    )


def saved_evidence(driver: webdriver.Chrome, tmp_path: Path) -> str:
    """What the browser showed when the test failed: a screenshot and the page's console."""
    path = tmp_path / "locust-ui-failure.png"
    driver.save_screenshot(str(path))
    console = "\n".join(entry["message"] for entry in driver.get_log("browser"))
    return f"screenshot {path}; header: {driver.find_element(By.TAG_NAME, 'header').text!r}; console:\n{console}"


def test_a_browser_runs_a_stepped_load_test_in_the_web_ui(stack, chromium, idle_locust, tmp_path):
    try:
        run_a_stepped_load_test_in_the_web_ui(stack, chromium, Screenshots(chromium, tmp_path))
    except Exception:
        print(saved_evidence(chromium, tmp_path))
        raise


def run_a_stepped_load_test_in_the_web_ui(stack, driver: webdriver.Chrome, screenshots: Screenshots) -> None:
    log_in(driver, "admin", stack.passwords["locust"])
    driver.get(stack.url("/locust/"))
    form = open_start_form(driver)
    offered = pick_user_class(driver, USER_CLASS)
    assert {"CompletionUser", "StreamingCompletionUser", "StreamingChatUser", "PrefixCacheUser"} <= set(offered)
    shape = Select(field_labelled(driver, "Shape Class"))
    assert SHAPE_CLASS in [option.text for option in shape.options]
    shape.select_by_visible_text(SHAPE_CLASS)
    # The shape decides how many users run: the UI locks the user count.
    WebDriverWait(driver, PAGE_TIMEOUT_S).until(lambda d: not field_labelled(d, "Number of users").is_enabled())
    screenshots.take("start")
    form.find_element(By.XPATH, ".//button[@type='submit' and normalize-space()='Start']").click()

    # Live statistics: the stepped shape's first step (one user) names its entries "[c=1]".
    entry = ("E2E", "/v1/completions [c=1]")

    def requests_counted(d: WebDriver) -> dict[str, str] | None:
        row = statistics_table(d).get(entry)
        return row if row and int(row["# Requests"]) >= 2 else None

    WebDriverWait(driver, STATS_TIMEOUT_S).until(requests_counted)
    assert header_value(driver, "Status").upper() == "RUNNING"
    live = statistics_table(driver)
    screenshots.take("running")
    served = locust_json(stack, "stats/requests")
    assert served["state"] == "running" and served["user_count"] >= 1, served["state"]
    by_entry = {(stat["method"] or "", stat["name"]): stat for stat in served["stats"]}
    assert set(live) <= set(by_entry), (sorted(live), sorted(by_entry))
    for key, row in live.items():
        assert int(row["# Fails"]) == 0, row
        # The JSON was read after the table, while the run went on: never fewer requests.
        assert by_entry[key]["num_requests"] >= int(row["# Requests"]) > 0, (row, by_entry[key])
        assert by_entry[key]["num_failures"] == 0
    assert float(live[entry]["Median (ms)"]) > 0
    assert ("POST", "/v1/completions [c=1]") in live

    header_button(driver, "Stop").click()
    wait_until_locust_idle(stack)
    WebDriverWait(driver, STATS_TIMEOUT_S).until(lambda d: header_value(d, "Status").upper() == "STOPPED")

    # Stopped, the table and Locust's JSON hold the same final numbers. The page stops polling once
    # it shows STOPPED, so a worker's last report that reaches the master after that shows only
    # after a reload (one CI run on 2 cores saw it): reload, as a user would, when it lags.
    last_reload = [time.monotonic()]

    def table_matches_json(d: WebDriver) -> bool:
        final, table = locust_entries(stack), statistics_table(d)
        matches = set(table) == set(final) and all(
            int(row["# Requests"]) == final[key]["num_requests"] and int(row["# Fails"]) == final[key]["num_failures"]
            for key, row in table.items()
        )
        if not matches and time.monotonic() - last_reload[0] > 10:
            d.refresh()
            last_reload[0] = time.monotonic()
        return matches

    try:
        WebDriverWait(driver, STATS_TIMEOUT_S).until(table_matches_json)
    except TimeoutException:
        raise AssertionError(f"table {statistics_table(driver)} != Locust's JSON {locust_entries(stack)}") from None
    final_table = statistics_table(driver)
    assert int(final_table[entry]["# Requests"]) >= int(live[entry]["# Requests"])
    assert float(final_table[entry]["Median (ms)"]) > 0
    screenshots.take("stopped")
    assert locust_json(stack, "stats/requests")["state"] == "stopped"
