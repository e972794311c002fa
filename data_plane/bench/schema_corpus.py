"""A corpus of 52 real-world JSON schemas for the structured-output benchmark (`bench engine --workload json`).

    for name, schema in CORPUS: ...

Shapes applications ask models for: API payloads (GitHub, Stripe, Slack, calendar, shipping), extraction
targets (people, invoices, receipts, resumes), nested objects, enums, arrays of objects, `$defs`/`$ref`,
optional fields and bounded strings and numbers, written the way pydantic and OpenAI's strict mode emit
them. Helpers keep each one short.
"""

from __future__ import annotations

from typing import Any

S: dict[str, Any] = {"type": "string", "maxLength": 40}
LONG: dict[str, Any] = {"type": "string", "maxLength": 200}
INT: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 100000}
NUM: dict[str, Any] = {"type": "number", "minimum": 0, "maximum": 1000000}
BOOL: dict[str, Any] = {"type": "boolean"}
DATE: dict[str, Any] = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}
EMAIL: dict[str, Any] = {"type": "string", "format": "email"}
URL: dict[str, Any] = {"type": "string", "maxLength": 80, "pattern": r"^https?://[^\s]+$"}


def obj(required: bool = True, **props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required else [],
            "additionalProperties": False}


def arr(items: Any, lo: int = 0, hi: int = 5) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


ADDRESS = obj(street=S, city=S, postal_code={"type": "string", "pattern": r"^[0-9A-Z -]{3,10}$"}, country=S)
MONEY = obj(amount=NUM, currency=enum("USD", "EUR", "GBP", "JPY"))
PERSON = obj(name=S, email=EMAIL, age=INT)
LINE = obj(description=S, quantity=INT, unit_price=NUM)

CORPUS: list[tuple[str, dict[str, Any]]] = [
    ("person", PERSON),
    ("address", ADDRESS),
    ("contact_card", obj(name=S, phone={"type": "string", "pattern": r"^\+?[0-9 -]{7,15}$"}, email=EMAIL,
                         company=nullable(S))),
    ("github_issue", obj(title=S, body=LONG, labels=arr(enum("bug", "enhancement", "question", "docs")),
                         assignees=arr(S, 0, 3), state=enum("open", "closed"))),
    ("github_pull_request", obj(title=S, head=S, base=S, draft=BOOL, reviewers=arr(S, 0, 3))),
    ("stripe_charge", obj(amount=INT, currency=enum("usd", "eur", "gbp"), customer=S, description=nullable(S),
                          capture=BOOL, metadata=obj(order_id=S))),
    ("stripe_customer", obj(name=S, email=EMAIL, address=ADDRESS, tax_exempt=enum("none", "exempt", "reverse"))),
    ("slack_message", obj(channel=S, text=LONG, thread_ts=nullable(S), unfurl_links=BOOL)),
    ("calendar_event", obj(title=S, start=DATE, end=DATE, attendees=arr(EMAIL, 0, 4), location=nullable(S),
                           recurrence=enum("none", "daily", "weekly", "monthly"))),
    ("meeting_notes", obj(topic=S, decisions=arr(S, 0, 4), action_items=arr(obj(owner=S, task=S, due=DATE), 0, 4))),
    ("invoice", obj(number=S, issued=DATE, due=DATE, seller=obj(name=S, address=ADDRESS),
                    buyer=obj(name=S, address=ADDRESS), lines=arr(LINE, 1, 4), total=MONEY)),
    ("receipt", obj(merchant=S, date=DATE, items=arr(obj(name=S, price=NUM), 1, 5), tax=NUM, total=NUM,
                    payment=enum("cash", "card", "mobile"))),
    ("resume", obj(name=S, email=EMAIL, skills=arr(S, 1, 6),
                   experience=arr(obj(company=S, role=S, start=DATE, end=nullable(DATE)), 0, 3),
                   education=arr(obj(school=S, degree=S, year=INT), 0, 2))),
    ("job_posting", obj(title=S, company=S, location=S, remote=enum("onsite", "hybrid", "remote"),
                        salary=obj(min=INT, max=INT, currency=enum("USD", "EUR")), requirements=arr(S, 1, 5))),
    ("product", obj(sku=S, name=S, price=MONEY, in_stock=BOOL, tags=arr(S, 0, 4),
                    dimensions=obj(width_cm=NUM, height_cm=NUM, depth_cm=NUM))),
    ("product_review", obj(product=S, rating=INT | {"maximum": 5}, title=S, pros=arr(S, 0, 3), cons=arr(S, 0, 3),
                           recommend=BOOL)),
    ("order", obj(order_id=S, customer=PERSON, items=arr(obj(sku=S, quantity=INT), 1, 5), shipping=ADDRESS,
                  status=enum("pending", "paid", "shipped", "delivered", "cancelled"))),
    ("shipment_tracking", obj(carrier=enum("ups", "fedex", "dhl", "usps"), tracking_number=S,
                              events=arr(obj(time=DATE, location=S, status=S), 0, 4))),
    ("flight_booking", obj(passenger=PERSON, origin={"type": "string", "pattern": "^[A-Z]{3}$"},
                           destination={"type": "string", "pattern": "^[A-Z]{3}$"}, date=DATE,
                           cabin=enum("economy", "premium", "business", "first"), bags=INT)),
    ("hotel_reservation", obj(hotel=S, check_in=DATE, check_out=DATE, guests=INT,
                              room=enum("single", "double", "suite"), breakfast=BOOL)),
    ("restaurant_booking", obj(restaurant=S, date=DATE, time={"type": "string", "pattern": r"^\d{2}:\d{2}$"},
                               party_size=INT, notes=nullable(S))),
    ("weather_report", obj(city=S, temperature_c={"type": "number", "minimum": -90, "maximum": 60},
                           conditions=enum("sunny", "cloudy", "rain", "snow", "storm"), humidity=INT,
                           forecast=arr(obj(day=S, high=NUM, low=NUM), 0, 3))),
    ("sentiment", obj(sentiment=enum("positive", "neutral", "negative"), confidence=NUM)),
    ("classification", obj(label=enum("spam", "ham"), reasons=arr(S, 0, 3))),
    ("topic_tags", obj(topics=arr(enum("sports", "politics", "tech", "health", "finance", "travel"), 1, 3))),
    ("named_entities", obj(entities=arr(obj(text=S, type=enum("person", "org", "place", "date")), 0, 6))),
    ("summary", obj(headline=S, summary=LONG, key_points=arr(S, 1, 4))),
    ("qa_answer", obj(answer=LONG, citations=arr(obj(title=S, url=URL), 0, 3), confidence=NUM)),
    ("translation", obj(source_language=enum("en", "fr", "de", "es", "it"),
                        target_language=enum("en", "fr", "de", "es", "it"), text=LONG)),
    ("sql_query", obj(query=LONG, tables=arr(S, 1, 3), read_only=BOOL)),
    ("code_review", obj(file=S, line=INT, severity=enum("info", "warning", "error"), comment=LONG)),
    ("bug_report", obj(title=S, steps=arr(S, 1, 5), expected=S, actual=S,
                       severity=enum("low", "medium", "high", "critical"), environment=obj(os=S, version=S))),
    ("support_ticket", obj(customer=PERSON, subject=S, category=enum("billing", "technical", "account", "other"),
                           priority=enum("low", "normal", "urgent"), message=LONG)),
    ("recipe", obj(name=S, servings=INT, ingredients=arr(obj(item=S, amount=S), 1, 6), steps=arr(S, 1, 5),
                   vegetarian=BOOL)),
    ("movie", obj(title=S, year=INT, genres=arr(enum("drama", "comedy", "action", "horror", "sci-fi"), 1, 3),
                  director=S, rating=NUM)),
    ("book", obj(title=S, authors=arr(S, 1, 3), isbn={"type": "string", "pattern": r"^[0-9-]{10,17}$"},
                 published=INT, publisher=nullable(S))),
    ("medication", obj(name=S, dose_mg=NUM, frequency=enum("daily", "twice_daily", "weekly", "as_needed"),
                       with_food=BOOL)),
    ("patient_intake", obj(patient=PERSON, symptoms=arr(S, 1, 5), allergies=arr(S, 0, 3), urgency=enum("routine",
                                                                                                 "soon", "emergency"))),
    ("bank_transfer", obj(from_account=S, to_account=S, amount=MONEY, reference=nullable(S), instant=BOOL)),
    ("expense", obj(date=DATE, category=enum("travel", "meals", "office", "software"), amount=MONEY,
                    description=S, reimbursable=BOOL)),
    ("stock_quote", obj(symbol={"type": "string", "pattern": "^[A-Z]{1,5}$"}, price=NUM, change_pct=NUM,
                        volume=INT)),
    ("crm_lead", obj(name=S, company=S, email=EMAIL, stage=enum("new", "contacted", "qualified", "won", "lost"),
                     value=MONEY, notes=arr(S, 0, 3))),
    ("user_settings", obj(theme=enum("light", "dark", "system"), language=enum("en", "fr", "de"),
                          notifications=obj(email=BOOL, push=BOOL, sms=BOOL), timezone=S)),
    ("feature_flag", obj(key=S, enabled=BOOL, rollout_percent=INT | {"maximum": 100}, segments=arr(S, 0, 3))),
    ("k8s_deployment", obj(name=S, namespace=S, replicas=INT | {"maximum": 50}, image=S,
                           ports=arr(obj(name=S, port=INT), 0, 3), env=arr(obj(name=S, value=S), 0, 4))),
    ("log_event", obj(timestamp=S, level=enum("debug", "info", "warn", "error"), service=S, message=LONG,
                      fields=obj(request_id=S, user=nullable(S)))),
    ("http_request", obj(method=enum("GET", "POST", "PUT", "DELETE"), url=URL,
                         headers=arr(obj(name=S, value=S), 0, 4), body=nullable(LONG))),
    ("survey_response", obj(respondent=S, answers=arr(obj(question=S, choice=enum("a", "b", "c", "d")), 1, 5),
                            nps=INT | {"maximum": 10})),
    ("quiz", obj(questions=arr(obj(question=S, options=arr(S, 2, 4), answer=INT | {"maximum": 3}), 1, 3))),
    ("tree_with_refs", {"$defs": {"node": {"type": "object", "properties": {
        "name": S, "children": arr({"$ref": "#/$defs/leaf"}, 0, 3)}, "required": ["name", "children"],
        "additionalProperties": False}, "leaf": obj(name=S, value=INT)},
        "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"],
        "additionalProperties": False}),
    ("org_chart_refs", {"$defs": {"employee": obj(name=S, title=S, email=EMAIL)}, "type": "object",
                        "properties": {"ceo": {"$ref": "#/$defs/employee"},
                                       "reports": arr({"$ref": "#/$defs/employee"}, 0, 4)},
                        "required": ["ceo", "reports"], "additionalProperties": False}),
    ("payment_method_oneof", obj(method={"anyOf": [
        obj(kind={"const": "card"}, last4={"type": "string", "pattern": "^[0-9]{4}$"}, brand=enum("visa", "mc")),
        obj(kind={"const": "bank"}, iban=S), obj(kind={"const": "paypal"}, email=EMAIL)]})),
]
